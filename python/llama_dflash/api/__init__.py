"""The entry points: the drop-in Llama, its completion loop, the OpenAI-compatible server,
the CLI, and the embedded default models."""
