"""The judgements on draft acceptance behind every MTP-aware gate: is the after side worse?

- :mod:`.acceptance`: paired samples, before and after (the canary per prompt, the fleet soak per
  window, the paired bench per request): the median change against a tolerance;
- :mod:`.noninferiority`: the live rule, a bootstrap non-inferiority test with three answers
  (``worse``, ``not worse``, ``not enough calls yet``; ADR 0019);
- :mod:`.traffic_acceptance`: the live traffic's draft acceptance in short windows of
  ``/metrics``, the samples the live rule judges.

The counter arithmetic is :mod:`appliance.engine_api.specdecode`'s; the gates that act on the
answers are the cutover's, the canary's, the soak's and bench's.
"""
