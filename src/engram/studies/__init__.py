"""Studies: experiments that train or probe models and report what they find: compare (dense vs
Engram vs MoE), sweep (allocation, table size), report (plots, gate figures), finetune (Engram
vs LoRA on a pretrained model), demo (the retrieval path on one sentence)."""
