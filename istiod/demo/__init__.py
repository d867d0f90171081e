"""A demo echo service and client: the README's walkthrough, and the real gRPC peers in tests."""
