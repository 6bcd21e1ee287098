"""kvtier: a Kubernetes-native, multimodal-aware KV-cache tier for vLLM."""

__version__ = "0.1.0"
