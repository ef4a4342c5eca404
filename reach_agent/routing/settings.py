"""What the routing reads of its settings: broker.toml's ``[routing]`` at a broker, the
table's copy of it at a caller (:class:`Settings`)."""

from __future__ import annotations

from typing import Literal, Protocol

Choice = Literal["weighted", "p2c", "ranked"]


class Settings(Protocol):
    """The routing settings (documented on the broker's ``RoutingSection``)."""

    @property
    def min_reach_score(self) -> float: ...
    @property
    def load_watermark(self) -> float: ...
    @property
    def choice(self) -> Choice: ...
    @property
    def pool_factor(self) -> int: ...
    @property
    def rank_refresh_ms(self) -> float: ...
    @property
    def slow_start_share(self) -> float: ...
    @property
    def slow_start_s(self) -> float: ...
    @property
    def max_eject_share(self) -> float: ...
    @property
    def panic_threshold(self) -> float: ...
