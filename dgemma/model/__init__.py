"""The model core: the architecture (model.py), its KV cache, configs, vision tower and experts."""
