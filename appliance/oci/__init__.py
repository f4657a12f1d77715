"""The image contract, in the standard library only (the serve program carries it).

- :mod:`.labels`: the OCI labels an appliance image carries and what they mean (ADR 0003);
- :mod:`.imageref`: the grammar of an image reference, checked before one reaches a file or
  Docker.

Building, tagging, listing and pruning images is :mod:`appliance.images`'.
"""
