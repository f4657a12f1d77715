"""The Gemma 4 MTP appliance: serve Gemma 4 on vLLM with MTP speculative decoding."""

__version__ = "0.1.0"
