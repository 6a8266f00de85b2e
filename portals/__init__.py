"""Portals: capabilities that grant a tenant access to a space (grant, attenuate,
verify, revoke, audit). A portal never reads weights itself."""
