"""A consumer's options, grouped and checked once: ``ConsumerSettings``.

``Consumer(address, stream, db=..., name=..., **options)`` builds one from its keyword
options (``ConsumerOptions`` types them), or takes one as ``settings=`` (keywords given
beside it replace its fields). The subscription, the failure policies and the metrics
endpoint each read their part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

from ..filters import Filter
from ..protocol import DEFAULT_MAX_FRAME_SIZE
from ..sql import Durability
from ..wire.security import ClientTLS
from .failures import DeadLetter, FailurePolicy, Retry, Stop

if TYPE_CHECKING:
    from ..metrics import ConsumerCollector, ServesMetrics

# Seconds a consumer waits for its own database to be usable again (a restart, a write
# lock held past the busy timeout) before it stops with ``DatabaseUnavailableError``.
DB_RECONNECT_TIMEOUT = 60.0


@dataclass(frozen=True, slots=True)
class ConsumerSettings:
    """A consumer's keyword options (``Consumer`` describes each), checked when made:
    ``ConsumerSettings(reconnect_timeout=30, on_failure=streamq.DeadLetter())``."""

    start_seq: int | None = None  # None: 1, unless another name's position is found
    start_time: int | None = None
    queue_batches: int = 16
    max_batch_records: int = 65536
    reconnect: bool = True
    reconnect_timeout: float | None = None
    db_reconnect_timeout: float | None = DB_RECONNECT_TIMEOUT
    connect_timeout: float = 10.0
    heartbeat_timeout: float | None = None
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    durability: Durability = "normal"
    tls: ClientTLS | None = None
    token: str | None = None
    on_failure: FailurePolicy | None = None  # None: Stop()
    filter: Filter | None = None
    share: tuple[int, int] | None = None
    ack_interval: float = 0.005
    allow_new_producer: bool = False
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    metrics: ServesMetrics | ConsumerCollector | None = None

    def __post_init__(self) -> None:
        if self.db_reconnect_timeout is not None and not self.db_reconnect_timeout >= 0:
            raise ValueError(
                "db_reconnect_timeout must be 0 or more seconds (None: no bound), "
                f"not {self.db_reconnect_timeout!r}"
            )
        if self.ack_interval < 0:
            raise ValueError(f"ack_interval must be 0 or more seconds, not {self.ack_interval!r}")
        if self.share is not None:
            if self.filter is not None and self.filter.share is not None:
                raise ValueError("give share= or a filter with a share, not both")
            Filter(share=self.share)  # checks the share
        if not isinstance(self.on_failure, Stop | Retry | DeadLetter | None):
            raise TypeError(
                "on_failure takes streamq.Stop(), streamq.Retry(...) or streamq.DeadLetter(...), "
                f"not {self.on_failure!r}"
            )
        if self.durability not in ("normal", "full"):
            raise ValueError(f"durability must be 'normal' or 'full', not {self.durability!r}")

    @property
    def start_given(self) -> bool:
        """The application chose where a new consumer starts (``start_seq``, ``start_time``)."""
        return self.start_seq is not None or self.start_time is not None

    @property
    def first_seq(self) -> int:
        """``start_seq``, 1 when not given."""
        return 1 if self.start_seq is None else self.start_seq

    @property
    def policy(self) -> FailurePolicy:
        """``on_failure``, ``Stop()`` when not given."""
        return Stop() if self.on_failure is None else self.on_failure

    @property
    def subscribed(self) -> Filter | None:
        """What the subscription asks the producer for: ``filter``, with ``share`` in it."""
        if self.share is None:
            return self.filter
        base = self.filter or Filter()
        return Filter(base.key_prefix, base.headers, self.share)


class ConsumerOptions(TypedDict, total=False):
    """``Consumer``'s keyword options, as ``ConsumerSettings`` takes them."""

    start_seq: int | None
    start_time: int | None
    queue_batches: int
    max_batch_records: int
    reconnect: bool
    reconnect_timeout: float | None
    db_reconnect_timeout: float | None
    connect_timeout: float
    heartbeat_timeout: float | None
    max_frame_size: int
    durability: Durability
    tls: ClientTLS | None
    token: str | None
    on_failure: FailurePolicy | None
    filter: Filter | None
    share: tuple[int, int] | None
    ack_interval: float
    allow_new_producer: bool
    metrics_port: int | None
    metrics_host: str
    metrics: ServesMetrics | ConsumerCollector | None
