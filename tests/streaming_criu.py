"""Plays CRIU's side of the image streamer protocol (criu/img-streamer.c), for tests:

    python3 tests/streaming_criu.py IMAGES_DIR OUT_DIR NAME...

connects to IMAGES_DIR/streamer-serve.sock and, for each NAME, asks for it, hands over a
pipe's write end and reads the content into OUT_DIR/NAME; after the whole of a file it
appends "NAME EOF" to OUT_DIR/seen (never for a file whose content stopped short: it is
killed first).  Exit 0 when every file was read, 3 when one does not exist."""

import os
import socket
import struct
import sys

images, out = sys.argv[1], sys.argv[2]
sk = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sk.connect(os.path.join(images, "streamer-serve.sock"))
for name in sys.argv[3:]:
    req = b"\x0a" + bytes([len(name)]) + name.encode()
    sk.sendall(struct.pack("<I", len(req)) + req)
    (n,) = struct.unpack("<I", sk.recv(4))
    reply = sk.recv(n)
    if reply != b"\x08\x01":
        sys.exit(3)
    r, w = os.pipe()
    socket.send_fds(sk, [b"\0"], [w])
    os.close(w)
    with open(os.path.join(out, name), "wb") as f:
        while data := os.read(r, 1 << 20):
            f.write(data)
    os.close(r)
    with open(os.path.join(out, "seen"), "a") as f:
        f.write(f"{name} EOF\n")
