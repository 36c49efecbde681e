"""Distillation of small draft models for a target (`specserve distill`): pure PyTorch, no Ray.

data.py (prompts, tokenisation, batches) -> teacher.py (target continuations and distributions) ->
student.py (the draft's shape and initialisation) -> trainer.py (KL distillation) -> export.py (the HF draft
directory the engine loads) -> evaluate.py (acceptance); pipeline.py runs them end to end.
"""
