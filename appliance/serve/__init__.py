"""The serve program: what every ``gemma4-vllm@<instance>.service`` runs (ADR 0009, ADR 0014).

``appliance instance install`` writes it to ``/usr/local/libexec/gemma4-vllm/serve`` as one zip
application (:mod:`.bundle`) run by the host's ``/usr/bin/python3``::

    serve INSTANCE run             check, then exec the engine's container (the unit's main process)
    serve INSTANCE print           print the docker command ``run`` would exec, and exit
    serve INSTANCE wait-healthy    return once vLLM's /health answers 200 (ExecStartPost)
    serve INSTANCE wait-generates  /health 200 and one generation (a multi-node head)
    serve INSTANCE probe           one generation; exit 1 when it fails (a multi-node head's probe)
    serve INSTANCE stop            stop the container, letting vLLM drain (ExecStop)
    serve INSTANCE remove          remove a leftover container (ExecStartPre, ExecStopPost)

Before ``run`` starts the engine it makes the unit's decisions with the same functions the
``appliance`` commands use: the env file's values (:mod:`appliance.host.values`), the API key
rule (:mod:`appliance.host.apikey`), the models present and complete (``models verify --quick``,
:mod:`appliance.models.verify`) and the image's labels choosing the MTP flags
(:mod:`appliance.engine_api.versions`). A configuration problem is one journal line and exit 78,
which the unit never restarts. This package and what it imports use the standard library only (and
``packaging``, carried in the zip): the host's Python has nothing else.
"""
