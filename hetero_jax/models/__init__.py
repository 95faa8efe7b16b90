"""The models as device math (`llama`, `bert`, `lora`, `layers`), their static configs, the
embedded presets and tokenizers; file formats live in `formats/`."""
