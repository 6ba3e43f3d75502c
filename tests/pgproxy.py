"""A TCP proxy in front of PostgreSQL that counts round trips and can lose a reply.

It reads the frontend protocol: each Sync ('S') or simple Query ('Q') message
ends one round trip. With ``drop_next_reply()`` armed, the next round trip is
forwarded to the server, the server's whole reply (up to ReadyForQuery, so the
statement has committed) is swallowed, and the connection is cut: the client
sees a dropped connection after its statement took effect. ``pause()`` makes
the database silent (nothing is forwarded, new connections hang) until
``resume()``, like a network partition that drops packets.

Two delays make a slow network: ``connect_delay`` (seconds) holds the first
bytes of each new connection that long before they go on, as a handshake
retransmitted across a partition that healed would be; ``delay_replies(s, about)``
holds the server's reply to the next round trip whose messages hold the bytes
``about`` (a lock's name, say) that long: the statement has run, its answer
comes late.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from pathlib import Path

from sqlalchemy.engine import make_url

_SSL_REQUEST = 80877103
_GSSENC_REQUEST = 80877104


def _upstream_address(url: str) -> tuple[int, object]:
    u = make_url(url)
    host = u.query.get("host") or u.host or "localhost"
    if isinstance(host, tuple):
        host = host[0]
    port = u.port or 5432
    if host.startswith("/"):
        sockets = sorted(p for p in Path(host).glob(".s.PGSQL.*") if not p.name.endswith(".lock"))
        path = next((str(p) for p in sockets if p.name == f".s.PGSQL.{port}"), str(sockets[0]) if sockets else "")
        return socket.AF_UNIX, path
    return socket.AF_INET, (host, port)


class PgProxy:
    def __init__(self, url: str) -> None:
        self.upstream_url = url
        self.family, self.address = _upstream_address(url)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.round_trips = 0
        self.queries = 0  # simple-protocol Query messages (e.g. BEGIN sent as text)
        self.connections = 0
        self.dropped = threading.Event()
        self.dropped_kinds: set[bytes] = set()  # message kinds of the round trip whose reply was lost
        self._drop_armed = False
        self.connect_delay = 0.0  # seconds the first bytes of each new connection are held
        self._delays: list[float] = []  # seconds each next round trip about _about has its reply held
        self._about = b""
        self._flowing = threading.Event()
        self._flowing.set()
        self._closing = False
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        u = make_url(self.upstream_url)
        query = {k: v for k, v in u.query.items() if k != "host"}
        return u.set(host="127.0.0.1", port=self.port, query=query).render_as_string(hide_password=False)

    def reset(self) -> None:
        with self.lock:
            self.round_trips = 0
            self.queries = 0

    def drop_next_reply(self) -> None:
        with self.lock:
            self._drop_armed = True
            self.dropped.clear()

    def delay_replies(self, seconds: float, about: bytes, times: int = 1) -> None:
        """Hold the replies of the next ``times`` round trips whose messages hold ``about`` ``seconds`` each."""
        with self.lock:
            self._delays, self._about = [seconds] * times, about

    def pause(self) -> None:
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def close(self) -> None:
        self._closing = True
        # shutdown() before close(): it wakes a thread blocked in accept() or
        # recv() and sends the FIN; close() alone does neither while another
        # thread is in a call on the socket, and the server session would wait
        # for ever (holding the locks of a statement sent without its Sync).
        _shutdown(self.listener, *self._socks)
        self.listener.close()
        for s in list(self._socks):
            try:
                s.close()
            except OSError:
                pass
        self._flowing.set()  # paused threads wake to dead sockets and end

    # -- plumbing ----------------------------------------------------------
    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self._closing:
                client.close()
                return
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no 40 ms Nagle stalls per message
            self._flowing.wait()
            server = socket.socket(self.family, socket.SOCK_STREAM)
            server.connect(self.address)
            self._socks += [client, server]
            with self.lock:
                self.connections += 1
            state = {"dropping": False, "delay": 0.0}
            threading.Thread(target=self._frontend, args=(client, server, state), daemon=True).start()
            threading.Thread(target=self._backend, args=(server, client, state), daemon=True).start()

    @staticmethod
    def _read(sock: socket.socket, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError
            data += chunk
        return data

    def _frontend(self, client: socket.socket, server: socket.socket, state: dict) -> None:
        try:
            if self.connect_delay:
                time.sleep(self.connect_delay)  # the handshake's first bytes arrive late
            while True:  # startup: answer SSL/GSS requests with 'N' ourselves
                (length,) = struct.unpack("!I", self._read(client, 4))
                body = self._read(client, length - 4)
                code = struct.unpack("!I", body[:4])[0]
                if code in (_SSL_REQUEST, _GSSENC_REQUEST):
                    client.sendall(b"N")
                    continue
                server.sendall(struct.pack("!I", length) + body)
                break
            kinds: set[bytes] = set()
            about = False  # this round trip's messages hold the bytes a delay is armed for
            while True:
                kind = self._read(client, 1)
                (length,) = struct.unpack("!I", self._read(client, 4))
                body = self._read(client, length - 4)
                kinds.add(kind)
                about = about or bool(self._delays and self._about in body)
                if kind in (b"S", b"Q"):
                    with self.lock:
                        self.round_trips += 1
                        if kind == b"Q":
                            self.queries += 1
                        if self._drop_armed:
                            self._drop_armed = False
                            state["dropping"] = True
                            self.dropped_kinds = kinds
                        if about and self._delays:
                            state["delay"] = self._delays.pop(0)
                    kinds, about = set(), False
                self._flowing.wait()
                server.sendall(kind + struct.pack("!I", length) + body)
        except (ConnectionError, OSError):
            pass
        finally:
            _shutdown(client, server)

    def _backend(self, server: socket.socket, client: socket.socket, state: dict) -> None:
        try:
            while True:
                kind = self._read(server, 1)
                (length,) = struct.unpack("!I", self._read(server, 4))
                body = self._read(server, length - 4)
                if state["delay"]:
                    delay, state["delay"] = state["delay"], 0.0
                    time.sleep(delay)  # the reply's first bytes come late, the rest after them
                if state["dropping"]:
                    if kind == b"Z":  # the statement is done and committed: cut the line
                        self.dropped.set()
                        raise ConnectionError
                    continue
                client.sendall(kind + struct.pack("!I", length) + body)
        except (ConnectionError, OSError):
            pass
        finally:
            _shutdown(client, server)


def _shutdown(*socks: socket.socket) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
