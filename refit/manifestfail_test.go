package refit

import (
	"strings"
	"testing"
	"time"

	"github.com/rollout-worker/rollout-worker/moe"
	"github.com/rollout-worker/rollout-worker/refit/refittest"
)

// TestRefitManifestMissingOrDisagreeing: a version whose bytes all arrived
// but whose manifest never comes is rejected after chunk_timeout, one whose
// manifest contradicts its announcement is rejected at once, and neither
// changes what the worker generates: the next full version applies.
func TestRefitManifestMissingOrDisagreeing(t *testing.T) {
	const chunkTimeout = 300 * time.Millisecond
	srv := refittest.StartServer(t)
	a, b, c := modelDir(t, 83), modelDir(t, 84), modelDir(t, 85)
	statuses := watchStatuses(t, srv.URL())
	w := startWorker(t, srv.URL(), a, "w", moe.RecipePerToken, func(cfg *ReceiverConfig) { cfg.ChunkTimeout = chunkTimeout })
	fullB := subset(t, b, nil)
	wantS, wantSc := fresh(t, a, moe.RecipePerToken)
	for _, tc := range []struct {
		name     string
		v        uint64
		manifest []jsonEdit
		write    bool
		want     string
	}{
		{"no manifest", 1, nil, false, "all bytes in, but no manifest after " + chunkTimeout.String()},
		{"manifest disagrees", 2, []jsonEdit{{field: "full", value: false}, {field: "base", value: 1}}, true,
			"announced full=true base=0, the manifest says full=false base=1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rawPublishEdited(t, srv.URL(), tc.v, fullB, true, 0, 4096, nil, tc.manifest, tc.write)
			st := statuses.wait(t, "w", tc.v)
			if st.State != StateRejected || !strings.Contains(st.Reason, tc.want) {
				t.Fatalf("version %d: %+v, want rejected: %q", tc.v, st, tc.want)
			}
			gotS, gotSc := rollouts(t, w.e)
			sameRollouts(t, "after a rejected version vs fresh A", gotS, gotSc, wantS, wantSc)
			if w.r.CurrentVersion() != 0 {
				t.Fatalf("serving version %d after a rejection, want 0", w.r.CurrentVersion())
			}
		})
	}
	publish(t, newPublisher(t, srv.URL()), 3, subset(t, c, nil), true)
	if st := statuses.wait(t, "w", 3); st.State != StateApplied {
		t.Fatalf("version 3 after two rejected ones: %+v", st)
	}
	residentEquals(t, "version 3", w.m, c)
}
