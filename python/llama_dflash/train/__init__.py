"""Making drafters: prompts, the target's responses and features on disk, the training loop,
and the resumable `llama-dflash train` run."""
