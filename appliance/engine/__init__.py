"""Running the real vLLM engine locally: the process entry point and its supervisor."""
