"""Image inputs (multimodal prompts): vLLM's ``multi_modal_data`` turned into placeholder tokens and pixel values.

``processor`` runs the model's Hugging Face processor on a prompt and its images; ``inputs`` holds what a request
carries to the engine core (pixel values, placeholder ranges, content hashes); ``media`` loads images from URLs;
``chat`` renders OpenAI content parts through the chat template.
"""
from pagedllm.multimodal.inputs import MultiModalFeature, PlaceholderRange

__all__ = ["MultiModalFeature", "PlaceholderRange"]
