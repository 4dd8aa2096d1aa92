"""Numbers the controller, the host agents and the workers must agree on, in one place."""

DEFAULT_STREAM = 0  # the stream id of every worker's main-thread stream

BIG_SEND = 1 << 20  # sends with more buffer bytes than this wait until ZeroMQ is done with them
PROGRESS_BYTES = 64 << 20  # transfers larger than this get a progress bar on both ends

RECV_HWM = 256  # messages queued per peer socket before ZeroMQ stops reading it: a flood
# waits in the sender

BEAT_S = 1.0  # how often a host agent's relay says it is alive (the controller expects it)
