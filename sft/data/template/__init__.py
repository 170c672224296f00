"""The chat template: rendered and probed once into one frozen profile (sft.data.template.profile.TemplateProfile)."""
