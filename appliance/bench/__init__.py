"""``appliance bench``: measure MTP against its baseline, on the appliance's prompts or yours.

Modules: ``prompts`` (shipped sets, JSONL loader), ``stream`` (one timed streamed request),
``runner`` (single and paired runs), ``stats`` (summaries, paired speedup CI), ``sweep`` (the k
sweep), ``report`` (Markdown summary, JSON artifact).
"""
