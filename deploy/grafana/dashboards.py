"""Writes deploy/grafana/dashboards/pdserve.json from `panels.py` with grafana-foundation-sdk.

    python -m deploy.grafana.dashboards          # rewrite the committed JSON
    python -m deploy.grafana.dashboards --check  # exit 1 if it is stale (what the tests run)

Variables: `datasource` (any Prometheus), `model`, `role` and `worker` (from the target labels
`pdserve serve --prometheus-targets` writes), and the SLOs `ttft_slo` / `tpot_slo`, whose choices
are histogram bucket boundaries (services/common/metrics.py), so attainment is exact.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus, timeseries
from grafana_foundation_sdk.builders.common import StackingConfig, VizLegendOptions
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    LegendDisplayMode,
    LegendPlacement,
    StackingMode,
)
from grafana_foundation_sdk.models.dashboard import (
    DataSourceRef,
    GridPos,
    VariableOption,
    VariableRefresh,
)

from deploy.grafana.panels import (
    ALL,
    DEFAULT_TPOT_SLO,
    DEFAULT_TTFT_SLO,
    ROWS,
    TPOT_SLOS,
    TTFT_SLOS,
    Panel,
)

OUT = Path(__file__).parent / "dashboards" / "pdserve.json"
UID = "pdserve-overview"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
WIDTH, HEIGHT = 8, 8  # three panels a row on Grafana's 24-column grid


def _option(value: str) -> VariableOption:
    return VariableOption(selected=True, text=value, value=value)


def _label_variable(name: str, query: str, label: str) -> gd.QueryVariable:
    return (
        gd.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(query)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .include_all(True)
        .all_value(ALL)
        .multi(True)
        .current(VariableOption(selected=True, text="All", value="$__all"))
    )


def _slo_variable(name: str, label: str, values: tuple[str, ...], default: str):
    return gd.CustomVariable(name).label(label).values(",".join(values)).current(_option(default))


def _panel(panel: Panel, panel_id: int, x: int, y: int) -> timeseries.Panel:
    built = (
        timeseries.Panel()
        .id(panel_id)
        .title(panel.title)
        .description(panel.answers)
        .unit(panel.unit)
        .datasource(DATASOURCE)
        .grid_pos(GridPos(h=HEIGHT, w=WIDTH, x=x, y=y))
        .legend(
            VizLegendOptions()
            .display_mode(LegendDisplayMode.LIST)  # type: ignore[arg-type]  # StrEnum: 3.11+
            .placement(LegendPlacement.BOTTOM)
            .show_legend(True)
        )
    )
    if panel.stacked:
        normal = StackingConfig().mode(StackingMode.NORMAL)  # type: ignore[arg-type]  # as above
        built = built.stacking(normal).fill_opacity(30)
    for index, query in enumerate(panel.queries):
        built = built.with_target(
            prometheus.Dataquery()
            .expr(query.expr)
            .legend_format(query.legend)
            .ref_id(chr(ord("A") + index))
            .datasource(DATASOURCE)
        )
    return built


def build() -> gd.Dashboard:
    """The pdserve dashboard."""
    board = (
        gd.Dashboard("pdserve")
        .uid(UID)
        .tags(["pdserve", "llm-serving"])
        .description(
            "A disaggregated prefill/decode pdserve cluster: latency, SLOs, TTFT legs, workers, "
            "KV transfer."
        )
        .refresh("10s")
        .time("now-30m", "now")
        .editable()
        .with_variable(gd.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            _label_variable("model", "label_values(pdserve_requests_total, model)", "Model")
        )
        .with_variable(
            _label_variable(
                "role", 'label_values(pdserve_kv_cache_usage_ratio{model=~"$model"}, role)', "Role"
            )
        )
        .with_variable(
            _label_variable(
                "worker",
                'label_values(pdserve_kv_cache_usage_ratio{model=~"$model", role=~"$role"}, '
                "worker)",
                "Worker",
            )
        )
        .with_variable(_slo_variable("ttft_slo", "TTFT SLO (s)", TTFT_SLOS, DEFAULT_TTFT_SLO))
        .with_variable(_slo_variable("tpot_slo", "TPOT SLO (s)", TPOT_SLOS, DEFAULT_TPOT_SLO))
    )
    y, ids = 0, iter(range(1, 1000))  # panel ids: unique within the dashboard
    for row in ROWS:
        board = board.with_row(
            gd.Row(row.title).id(next(ids)).grid_pos(GridPos(h=1, w=24, x=0, y=y))
        )
        y += 1
        for index, panel in enumerate(row.panels):
            x = (index % 3) * WIDTH
            if index and index % 3 == 0:
                y += HEIGHT
            board = board.with_panel(_panel(panel, next(ids), x, y))
        y += HEIGHT
    return board


def render() -> str:
    """The dashboard's JSON, as committed."""
    return JSONEncoder(sort_keys=True, indent=2).encode(build().build()) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the JSON is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python -m deploy.grafana.dashboards", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
