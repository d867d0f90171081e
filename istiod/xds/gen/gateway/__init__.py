"""Envoy gateways (node type `router`): the servers of the Gateways that select the proxy's labels,
as istiod builds them (networking/core gateway.go). Listeners per server port, routes from the
VirtualServices bound to each Gateway, the mesh's outbound clusters (shared with sidecars), EDS
(shared), and the `kubernetes://<credentialName>` certificates over SDS on the ADS stream."""
