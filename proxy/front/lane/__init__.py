"""The lane: every client connection is read here first, by httptools (llhttp), without aiohttp's server machinery.

aiohttp's request and response objects, payload writer and handler task cost more CPU per request than a bare
forwarder's whole hop (bench/ab.py), and most requests need none of them. The lane serves these itself, in every
configuration:
- a 2026-07-28 request the proxy does not own (`dispatch.relayed_unowned`), posted upstream with the lean client
  and its answer written back as the upstream sent it, or bridged to a 2025-era upstream;
- a 2025-era client's request the proxy does not own (`dispatch.relayed_as_is`), to an HTTP upstream as it came;
- `tasks/get`, `tasks/update` and `tasks/cancel` of a 2026 client, and its `tools/call` that declares tasks for a
  tool the policy runs as a task (`dispatch.answered_here`): the proxy's own answers, from the same code as
  aiohttp's path.
Every other `POST /mcp` (SEP-1686 for 2025 clients, durable and kept-alive calls, subscriptions/listen, discovery,
notifications, responses and batches, and any the proxy refuses) the lane reads too, and the application's handler
answers it on the lane's connection (proxy/front/lane/handlers.py): aiohttp's request and response objects, the
same route and boundary as for a request aiohttp's own reader read. Any other request (GET, DELETE, another path,
HTTP/1.0, a head only aiohttp's reader may judge) hands aiohttp the connection for good.

What the lane's requests get is the front door's boundary (proxy/front/boundary.py, as aiohttp's do): the
Host/Origin guard, the request id, the span, the request's metrics and log line, and a JSON-RPC error for every
failure; with the size and time bounds of `listen` and `limits`, and cancellation upstream when the client leaves.
With replicas routing sessions (`listen.advertise_url`), a request that may name a 2025 session or a parked call is
the application's handler's, which routes it.

Modules: `server.py` (the protocol factory and the deadlines' one timer), `connection.py` (reading: parsing,
pipelining), `routing.py` (which requests it reads and serves: the head in one pass, then the body), `answers.py`
(serving one request, behind the error boundary), `writer.py` (framing the answers), `handlers.py` (the
application's handler on the lane's connection), `backlog.py` (what a connection pipelines meanwhile).
"""

from aiohttp import web

from .connection import LaneConnection
from .server import Lane

__all__ = ["Lane", "open_lane"]


def open_lane(app: web.Application, handlers: web.Server, *, header_timeout_s: float) -> Lane:
    """The lane for a started `app`, handing what it does not serve to `handlers` (aiohttp's web.Server)."""
    return Lane(app, handlers, LaneConnection, header_timeout_s=header_timeout_s)
