"""Stand-ins for backends that cannot be installed here, with signatures checked against upstream."""
