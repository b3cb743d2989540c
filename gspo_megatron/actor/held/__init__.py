"""The policies an Actor holds besides the live one, on the host: the KL reference and the weights of
recent versions (snapshots.py), swapped in for forward passes (policies.py: the Actor's part that does
it), and which version computed each recorded route (versioned_routes.py)."""
