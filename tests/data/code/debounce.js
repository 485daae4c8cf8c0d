// Call `fn` once calls have stopped for `wait` milliseconds; `flush` runs a pending call now.
export function debounce(fn, wait = 100) {
  let timer = null;
  let lastArgs = null;

  function run() {
    timer = null;
    const args = lastArgs;
    lastArgs = null;
    return fn(...args);
  }

  function debounced(...args) {
    lastArgs = args;
    if (timer !== null) {
      clearTimeout(timer);
    }
    timer = setTimeout(run, wait);
  }

  debounced.flush = () => {
    if (timer === null) return undefined;
    clearTimeout(timer);
    return run();
  };

  debounced.cancel = () => {
    if (timer !== null) clearTimeout(timer);
    timer = null;
    lastArgs = null;
  };

  return debounced;
}
