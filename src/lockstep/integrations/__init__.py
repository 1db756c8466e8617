"""Integrations with other libraries (optional extras): `lockstep.integrations.trl` for TRL."""
