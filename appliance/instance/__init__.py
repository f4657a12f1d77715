"""An installed instance, seen from the commands: installing it, what the host says about it,
and which engine a command talks to.

- :mod:`.installer`: install or render a NAME of either shape, and the next step an operator
  types;
- :mod:`.instance_facts`: what the host says about an installed instance (unit, env file,
  record, container), never raising;
- :mod:`.endpoint`: an instance's NAME or a URL, to the engine a command talks to.

The instance's record and files are :mod:`appliance.units`'; its API key file's rule is
:mod:`appliance.host.apikey`.
"""
