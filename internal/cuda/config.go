package cuda

import (
	"os"
	"path/filepath"
)

// Environment variables that supply a default for the Config field of the
// same meaning when that field is empty.
const (
	EnvLibCUDA    = "ROLLOUT_WORKER_LIBCUDA"      // Config.LibCUDA
	EnvLibNVRTC   = "ROLLOUT_WORKER_LIBNVRTC"     // Config.LibNVRTC
	EnvIncludeDir = "ROLLOUT_WORKER_CUDA_INCLUDE" // Config.IncludeDir
	EnvCacheDir   = "ROLLOUT_WORKER_CUBIN_CACHE"  // Config.CacheDir
)

// Built-in defaults, used when neither the Config field nor its environment
// variable is set.
const (
	DefaultLibCUDA    = "libcuda.so.1"
	DefaultIncludeDir = "/usr/local/cuda/include"
)

// defaultLibNVRTC is tried in order when LibNVRTC is not configured.
var defaultLibNVRTC = []string{"libnvrtc.so", "libnvrtc.so.13"}

// CacheOff as Config.CacheDir (or its environment variable) disables the
// on-disk cubin cache.
const CacheOff = "off"

// Config says where the CUDA libraries and headers are and which device to
// open. The zero value is usable: every empty field takes its environment
// variable, then the built-in default.
type Config struct {
	// LibCUDA is the driver library passed to dlopen
	// (ROLLOUT_WORKER_LIBCUDA, default "libcuda.so.1").
	LibCUDA string
	// LibNVRTC is the runtime compiler library (ROLLOUT_WORKER_LIBNVRTC,
	// default "libnvrtc.so", then "libnvrtc.so.13").
	LibNVRTC string
	// IncludeDir holds the CUDA headers (cuda_bf16.h, ...) and is passed to
	// NVRTC as -I (ROLLOUT_WORKER_CUDA_INCLUDE, default
	// "/usr/local/cuda/include"). NVRTC searches no directory by itself.
	IncludeDir string
	// CacheDir holds compiled cubins (ROLLOUT_WORKER_CUBIN_CACHE, default
	// os.UserCacheDir()/rollout-worker/cubin; "off" disables the cache).
	CacheDir string
	// Ordinal is the device index, as cuDeviceGet counts (default 0).
	Ordinal int
}

// resolved returns c with every empty field filled from the environment,
// then from the defaults. nvrtc lists the NVRTC libraries to try in order.
func (c Config) resolved() (r Config, nvrtc []string) {
	r = c
	pick := func(field *string, env, def string) {
		if *field == "" {
			*field = os.Getenv(env)
		}
		if *field == "" {
			*field = def
		}
	}
	pick(&r.LibCUDA, EnvLibCUDA, DefaultLibCUDA)
	pick(&r.IncludeDir, EnvIncludeDir, DefaultIncludeDir)
	pick(&r.CacheDir, EnvCacheDir, defaultCacheDir())
	if r.LibNVRTC == "" {
		r.LibNVRTC = os.Getenv(EnvLibNVRTC)
	}
	if r.LibNVRTC != "" {
		nvrtc = []string{r.LibNVRTC}
	} else {
		nvrtc = defaultLibNVRTC
	}
	return r, nvrtc
}

// defaultCacheDir is os.UserCacheDir()/rollout-worker/cubin, or "off" when
// the user has no cache directory (no HOME, no XDG_CACHE_HOME).
func defaultCacheDir() string {
	d, err := os.UserCacheDir()
	if err != nil || d == "" {
		return CacheOff
	}
	return filepath.Join(d, "rollout-worker", "cubin")
}
