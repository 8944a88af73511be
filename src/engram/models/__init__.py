"""Models that carry Engram: the reference LM (model, layers, model_config) and injection into
Hugging Face models (hf) with small adapters (adapter), pretrained models by name or folder
(pretrained); a forward's device and compute precision (precision). A new model family goes in hf.py
as one adapter function."""
