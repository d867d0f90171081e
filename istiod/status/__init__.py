"""What istiod writes back to the cluster as status (leader-elected)."""
