// The shape kvtier's dashboards must have, from Grafana's own schema package
// (@grafana/schema, installed by scripts/obs-env). test_dashboards.py writes each
// dashboard JSON as `const dashboard: KvtierDashboard = <json>;` next to this file
// and runs `tsc --noEmit --strict`: unknown keys, wrong types, missing required
// fields and unknown panel types fail.
import type {
  DataQuery,
  Dashboard,
  FieldConfigSource,
  Panel,
  RowPanel,
} from '@grafana/schema';
import type { Options as StatOptions } from '@grafana/schema/dist/esm/raw/composable/stat/panelcfg/x/StatPanelCfg_types.gen';
import type {
  FieldConfig as TimeSeriesFieldConfig,
  Options as TimeSeriesOptions,
} from '@grafana/schema/dist/esm/raw/composable/timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen';

// JSON carries enum members as their string values ("value", "absolute"): accept
// exactly those strings where the schema has a string enum.
type Loose<T> = T extends string
  ? `${T}`
  : T extends Array<infer E>
    ? Array<Loose<E>>
    : T extends object
      ? { [K in keyof T]: Loose<T[K]> }
      : T;

// Grafana's Prometheus query (the datasource plugin's own type is not in
// @grafana/schema): the fields kvtier's panels use.
interface PrometheusQuery extends DataQuery {
  expr: string;
  legendFormat?: string;
  instant?: boolean;
  range?: boolean;
  interval?: string;
}

type PanelBase = Loose<Omit<Panel, 'type' | 'options' | 'fieldConfig' | 'targets'>> & {
  title: string;
  description: string;
  gridPos: { x: number; y: number; w: number; h: number };
  targets: Array<Loose<PrometheusQuery>>;
};

type StatPanel = PanelBase & {
  type: 'stat';
  options: Loose<StatOptions>;
  fieldConfig: Loose<FieldConfigSource>;
};

type TimeSeriesPanel = PanelBase & {
  type: 'timeseries';
  options: Loose<TimeSeriesOptions>;
  fieldConfig: Loose<FieldConfigSource<TimeSeriesFieldConfig>>;
};

type Row = Loose<Omit<RowPanel, 'type' | 'panels'>> & { type: 'row'; panels: [] };

export type KvtierDashboard = Loose<Omit<Dashboard, 'panels'>> & {
  uid: string;
  title: string;
  panels: Array<StatPanel | TimeSeriesPanel | Row>;
};
