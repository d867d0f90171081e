"""A gRPC external authorizer (envoy.service.auth.v3.Authorization) for ext_authz tests: allows a
request whose `x-ext-authz` header is `allow` (adding `x-ext-authz-check-result: allowed-grpc`
upstream), denies the rest with 403 `denied by grpc ext_authz`."""

import asyncio
import sys

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc
from envoy.type.v3 import http_status_pb2
from google.rpc import status_pb2  # type: ignore[import-untyped]


class Authorization(external_auth_pb2_grpc.AuthorizationServicer):
    async def Check(self, request: external_auth_pb2.CheckRequest,  # noqa: N802 (the proto's name)
                    context: grpc.aio.ServicerContext) -> external_auth_pb2.CheckResponse:
        if request.attributes.request.http.headers.get("x-ext-authz") == "allow":
            header = base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="x-ext-authz-check-result",
                                                                            value="allowed-grpc"))
            return external_auth_pb2.CheckResponse(status=status_pb2.Status(code=0),
                                                   ok_response=external_auth_pb2.OkHttpResponse(headers=[header]))
        return external_auth_pb2.CheckResponse(
            status=status_pb2.Status(code=7),
            denied_response=external_auth_pb2.DeniedHttpResponse(
                status=http_status_pb2.HttpStatus(code=403), body="denied by grpc ext_authz"))  # type: ignore[arg-type]


async def main() -> None:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    external_auth_pb2_grpc.add_AuthorizationServicer_to_server(Authorization(), server)
    server.add_insecure_port(f"{sys.argv[1]}:{sys.argv[2]}")
    await server.start()
    await server.wait_for_termination()


asyncio.run(main())
