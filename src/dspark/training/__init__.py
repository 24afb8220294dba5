"""Drafter training: answer regeneration (datagen), the target cache, packing, losses and the trainer.

Uses models, drafters and decoding; never the engine or the server. Submodules are imported on demand so
`import dspark.training` stays cheap.
"""
