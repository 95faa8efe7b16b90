"""File formats, apart from the device math: safetensors, Hugging Face Llama and BERT
checkpoints, PEFT LoRA adapters, sentence-transformers pooling configs."""
