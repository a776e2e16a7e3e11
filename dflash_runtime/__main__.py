import signal
import sys

# Ctrl+C during the imports (a second or two) exits as the command line does once it runs: no traceback.
interruptible = signal.getsignal(signal.SIGINT) is signal.default_int_handler
if interruptible:
    signal.signal(signal.SIGINT, lambda *_: sys.exit(128 + signal.SIGINT))

from .cli.main import main  # noqa: E402

if interruptible:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # from here `main` says "stopped"
raise SystemExit(main())
