"""pysyncobj, the Raft library the coordinator set runs on, imported without its side effect.

pysyncobj 0.3.17's ``win_inet_pton`` replaces :func:`socket.inet_ntop` on every platform with a
Windows-only version (its ``if os.name == 'nt'`` guards only ``inet_pton``). In this process that
broke everything that formats a packed address, psutil's connection listing among them (``TypeError:
not_windows() takes 0 positional arguments``). Importing pysyncobj through this module puts the C
function back, whichever module imported pysyncobj first.
"""

from __future__ import annotations

import _socket
import socket

import pysyncobj  # noqa: F401  (the import that patches socket.inet_ntop)

socket.inet_ntop = _socket.inet_ntop
