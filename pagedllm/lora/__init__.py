"""LoRA adapters served on one base model (vLLM's multi-LoRA): each request may name its own adapter."""
