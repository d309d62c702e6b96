// Package metriclint holds no code: its test registers every Prometheus
// metric set the project defines on one registry, as serve does, and lints
// the names (promlint's rules, the project's rollout_worker_ prefix, no
// collisions between sets).
package metriclint
