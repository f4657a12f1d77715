"""A fleet of appliance hosts, driven by Ansible (deploy/ansible, ADR 0012): the per-host steps
the playbooks run (the canary's soak, status, Prometheus targets for an inventory)."""
