"""Data preparation, one way (docs/layout.md, "The data wing", names every file's job):

    source file --sources--> raw record --records, messages--> Conversation
        --samples.encode_samples (the chat template: chat, profile, forms, turns, thinking, end_tokens; too long:
          long_conversations, split_turns)--> samples or a refusal.Refusal, counted in a report.TruncationReport
        --dataset (shards, cache_key; a lazy dataset)--> memory-mapped Arrow shards --packing, collators--> batches
"""
