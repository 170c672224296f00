"""Data preparation, one way, in stages (a folder each; docs/layout.md, "The data wing", names every file's job):

    records/   source file --sources--> raw record --records, messages--> Conversation (no tokenizer)
    template/  the chat template rendered (chat) and probed once (profile: TemplateProfile; forms, end_tokens)
    encode/    Conversation + profile --samples.encode_samples--> ConversationSamples or a refusal.Refusal: labels
               reply by reply (turns, thinking), dropped content, prompt_cut, splitting (long_conversations,
               split_turns), truncation and its report.TruncationReport
    store/     samples --dataset (shards, cache_key; a lazy dataset)--> memory-mapped Arrow shards
    batches/   shards --packing, collators--> batches
"""
