"""An HTTP/1.1 forward proxy for TCP, as an egress proxy outside the mesh: a CONNECT to
`host:port`, or a POST whose Host is `host:port` (the client's bytes in its chunked body, the
server's in the chunked response), opens a connection to the address the routes map that name to
and copies the bytes both ways; what is not HTTP/1 gets a 400. Prints {"serving": ...} once
listening, then one JSON line per request: its method, target and headers (or the raw line). Arguments: address, port, then routes `host:port=ip:port`."""

from __future__ import annotations

import asyncio
import json
import sys

ROUTES = dict(route.split("=", 1) for route in sys.argv[3:])


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()


async def _unchunk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A chunked request body's payload, as it arrives."""
    while size := int((await reader.readline()).split(b";")[0].strip() or b"0", 16):
        writer.write(await reader.readexactly(size))
        await reader.readexactly(2)  # the CRLF after the chunk
        await writer.drain()
    writer.write_eof()


async def _chunk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(b"%x\r\n%s\r\n" % (len(data), data))
        await writer.drain()
    writer.write(b"0\r\n\r\n")
    await writer.drain()


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        request = (await reader.readline()).decode("latin-1").rstrip("\r\n")
        method, target, version = (request.split(" ", 2) + ["", ""])[:3]
        if not version.startswith("HTTP/1."):  # not HTTP: a client's own bytes
            print(json.dumps({"method": "", "raw": request}), flush=True)
            writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            return
        lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines if line)}
        authority = target if method == "CONNECT" else headers.get("host", "")
        print(json.dumps({"method": method, "target": authority, "path": "" if method == "CONNECT" else target,
                          "headers": headers}), flush=True)
        if method not in ("CONNECT", "POST") or authority not in ROUTES:
            writer.write(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            return
        host, _, port = ROUTES[authority].rpartition(":")
        upstream_reader, upstream_writer = await asyncio.open_connection(host, int(port))
        try:
            if method == "CONNECT":
                writer.write(b"HTTP/1.1 200 OK\r\n\r\n")
                await asyncio.gather(_copy(reader, upstream_writer), _copy(upstream_reader, writer))
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                sending = _unchunk(reader, upstream_writer) if headers.get("transfer-encoding") == "chunked" \
                    else _copy(reader, upstream_writer)
                await asyncio.gather(sending, _chunk(upstream_reader, writer))
        finally:
            upstream_writer.close()
    except (OSError, ValueError, asyncio.IncompleteReadError) as error:
        print(json.dumps({"error": repr(error)}), flush=True)
    finally:
        writer.close()


async def main() -> None:
    server = await asyncio.start_server(_handle, sys.argv[1], int(sys.argv[2]))
    print(json.dumps({"serving": f"{sys.argv[1]}:{sys.argv[2]}"}), flush=True)
    async with server:
        await server.serve_forever()


asyncio.run(main())
