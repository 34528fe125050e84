"""Front end: `.sched` text -> syntax tree (`parser`) -> Schedule IR (`elaborate`)."""
