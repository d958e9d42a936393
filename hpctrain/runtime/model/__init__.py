"""The model: the transformer (transformer.py), its norm (norm.py), sharded initialisation from the seed
(init.py), LoRA adapters (lora.py) and Hugging Face weights for `model.init_from` (hf_weights.py)."""
