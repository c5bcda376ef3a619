"""Imported first by the forkserver that hsdp starts, and by nothing else: it ignores SIGINT and SIGTERM from then on.

A signal to the caller's process group (a terminal's Ctrl-C, systemd's stop, ``timeout``, ``kill -- -PGID``) reaches
the forkserver too. Its meaning is the caller's to decide (a server finishes its running batch; a command stops its
ranks), so the forkserver must not die of it, nor its ranks inherit a default that ends them before they set their
own (:func:`hsdp.launch.rank._worker_main`). The caller cannot hand the forkserver an ignored disposition: it would
have to ignore the signals itself while the forkserver starts, and a signal in that window was lost to the caller
(``hsdp train`` trained on after a SIGTERM). So the forkserver sets it itself, as its first preloaded import
(:func:`hsdp.launch.group.preload_modules`), a few milliseconds after it starts; a signal before that ends the
forkserver, which later groups survive (they spawn their ranks).
"""

import signal

for _signal in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_signal, signal.SIG_IGN)
