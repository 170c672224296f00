"""The model: loading (tokenizer, model, 4-bit, pre-quantized, LoRA), attention for packed rows, the loss, export."""
