"""Records: a source file -> raw records -> validated conversations (records.Conversation); no tokenizer."""
