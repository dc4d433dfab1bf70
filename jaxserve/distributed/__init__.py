"""Beyond one device: the sharding rules over a mesh, the multi-host group, and the channel that
carries each step from the leader to its followers."""
