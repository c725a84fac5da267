"""Adapters that plug flashattn into other libraries. Each submodule imports its library only when used:
`flashattn.integrations.transformers.register()` for Hugging Face transformers 5.x."""
