"""Running the real vLLM engine locally: the process entry point and its supervisor, and the
tiny Gemma 4 models it serves on a CPU (:mod:`.devmodel`)."""
