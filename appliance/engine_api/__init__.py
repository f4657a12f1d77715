"""What the appliance reads of a running vLLM engine, over its HTTP API.

- :mod:`.vllm_client`: one client for a vLLM server (health, version, models, one generation);
- :mod:`.metrics_reader`: the one bounded reader of its ``/metrics``;
- :mod:`.specdecode`: the speculative-decoding counters, parsed, and all arithmetic on them;
- :mod:`.probe`: the one "is MTP working here?" probe (doctor, the cutover gate, bench);
- :mod:`.shed`: a request turned away at the queue bound is "try again", not a verdict;
- :mod:`.versions`: vLLM versions, one ordering, one "does it serve Gemma 4 MTP?".

Standard library only here: the serve program carries this file (``serve/bundle.py``).
"""
