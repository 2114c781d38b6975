/* The rings' per-call hot path in C: the same steps as the Python reference, on the same state.
 *
 * Built and loaded by bufreuse/native/__init__.py; docs/pool.md, "The C hot path", says what it saves.
 *
 * State: Slot, Ops, Ring, Held, Route and Tracker are C structs whose members carry the Python code's attribute
 * names; the pool's classes (_Slot, DeviceOps, BufferRing, SavedTracker) and the integration's (Held, Fc2Route)
 * derive from them when this extension loads, so Python reads and writes the same fields through member
 * descriptors and the functions below read them directly. On the H200 host the hooks' cost was cache misses on
 * the attribute lookups of Python objects (a C version doing the same lookups saved ~10%): direct fields are what
 * makes the difference.
 *
 * Functions:
 *   acquire(ring, shape)           BufferRing.acquire's common case, or None: the caller runs the Python method
 *   release(ring, tensor)          BufferRing.release's common case (nothing saved or held): True, or None
 *   release_when_unsaved(ring, tensor)
 *                                  its common cases: True (released now), False (deferred: a saved reference or
 *                                  a hold still reads the slot, this reader's mark left), or None (Python method)
 *   held_release(held)             Held.release with the above
 *   Pack(spans, strict)            the saved-tensor pack hook (tracking._pack_unpack); a held slot's saved
 *                                  reference is a SavedRef (tracking._SavedRef derives from it), counted in C
 *   unpack(packed)                 the unpack hook
 *   SavedRef                       its finalizer is the deferred release (SavedRefCounting._untrack's common
 *                                  cases; untrack(ring, slot, generation, epoch) runs it for the tests)
 *   AfterStage(stage, queue, tracker)
 *                                  call a stage (inside the tracker's saved-tensor region when its first
 *                                  argument views a queued acquisition); release the queue's front once the
 *                                  stage's output no longer views it
 *   IntoRing(route_attr, fallback, held_type, ignored)
 *                                  a method: acquire rows = inp.shape[0] from the route's ring and call the
 *                                  route's forward with out= the slot; queue a held acquisition
 *
 * Every fast path checks all it needs before it changes anything, and otherwise answers "not mine" (None)
 * or calls the Python fallback, which then does exactly what it always did: debug mode, CUDA-graph phases,
 * waits on an elided event, readers on other streams, a ring lock another thread holds, fallback allocations and
 * the errors Python words (refusals, misuse) stay in Python; errors from the calls themselves (an input without
 * rows, a failing event record) are raised where they happen, as the Python code raises them.
 * Only the Python C API is used (no torch headers), so one source builds against any torch;
 * tests/test_native_hotpath.py runs both paths side by side.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stddef.h>
#include <stdint.h>

#define FALLBACK 0
#define DONE 1
#define DEFERRED 2 /* release_when_unsaved: the release waits for the slot's readers (done, not released now) */

#if PY_VERSION_HEX < 0x030C0000 /* Python 3.11: PyErr_GetRaisedException / SetRaisedException are 3.12's */
static PyObject *PyErr_GetRaisedException(void) {
  PyObject *t, *v, *tb;
  PyErr_Fetch(&t, &v, &tb);
  if (t == NULL) return NULL;
  PyErr_NormalizeException(&t, &v, &tb);
  if (tb != NULL) PyException_SetTraceback(v, tb);
  Py_DECREF(t);
  Py_XDECREF(tb);
  return v;
}

static void PyErr_SetRaisedException(PyObject *v) {
  if (v == NULL) return;
  PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(v)), v, PyException_GetTraceback(v));
}
#endif

static PyObject *EAGER = NULL;     /* bufreuse.pool._state.Phase.EAGER */
/* torch.Tensor and collections.deque, and their descriptors, looked up once (configure): a call on an object of
 * exactly that type goes to the descriptor, with no attribute lookup on the type (cold on a busy host) */
static PyTypeObject *TENSOR = NULL, *DEQUE = NULL;
static PyObject *T_DATA_PTR = NULL, *T_DETACH = NULL, *T_DTYPE = NULL, *T_SHAPE = NULL, *D_POPLEFT = NULL,
                *D_APPEND = NULL;
static PyObject *EMPTY = NULL;     /* () */

#define NAMES(X) X(data_ptr) X(detach) X(_track) X(_untrack) X(release_when_unsaved) X(release) X(out) X(popleft) \
  X(append) X(shape) X(dtype) X(acquire) X(unpack)

#define DECLARE(n) static PyObject *s_##n;
NAMES(DECLARE)
#undef DECLARE

/* ---- the state the hot path reads: C structs with the Python code's attribute names ----------------------
 * The pool's classes derive from these when the extension loads (bufreuse/native): Python reads and
 * writes the same fields through member descriptors, the C code directly (no attribute lookup: on a host
 * whose caches the model's own work evicts between layer calls, each lookup costs several cache misses). */

typedef struct {
  PyObject_HEAD
  PyObject *base, *capture_event, *eager_event, *live, *made_on, *marks, *wait_on, *wait_stream;
  Py_ssize_t generation, holds, index, saved_refs;
  char late, pending;
} Slot;

typedef struct {
  PyObject_HEAD
  PyObject *_by_ptr, *_index, *_raw, *capturing, *device, *record, *wait;
  char cuda;
} Ops;

typedef struct {
  PyObject_HEAD
  PyObject *_phase, *_slots, *_by_id, *_ops, *_fallback, *_watchdog, *max_shape, *_slot_map, *_lock, *_spare_events,
      *_hot;
  Py_ssize_t _cursor, num_slots, _generation, _acquisitions, _held, _deferred_freed, _peak_held, _gpu_waits,
      _elided, _releases, _epoch, _deferred, _marks_elided, _deferred_elided, slot_bytes;
  char debug, _cuda, _elide;
} Ring;

typedef struct {
  PyObject_HEAD
  PyObject *pool, *name, *tensor, *entry;
  Py_ssize_t lo, hi;
  char released, deferred;
} Held;

typedef struct {
  PyObject_HEAD
  PyObject *pool, *name, *entry, *dtype, *queue, *te_forward;
  Py_ssize_t cols, row_bytes;
} Route;

typedef struct {
  PyObject_HEAD
  PyObject *_push, *_pop;
  Py_ssize_t _depth, regions;
  char strict;
} Tracker;

typedef struct {
  PyObject_HEAD
  PyObject *tensor, *ring, *slot;
  Py_ssize_t generation, epoch;
} SavedRef;

#define OBJ(T, f) {#f, T_OBJECT_EX, offsetof(T, f), 0, NULL}
#define SSZ(T, f) {#f, T_PYSSIZET, offsetof(T, f), 0, NULL}
#define BOOL(T, f) {#f, T_BOOL, offsetof(T, f), 0, NULL}

static PyMemberDef slot_members[] = {
    OBJ(Slot, base), OBJ(Slot, capture_event), OBJ(Slot, eager_event), OBJ(Slot, live), OBJ(Slot, made_on),
    OBJ(Slot, marks), OBJ(Slot, wait_on), OBJ(Slot, wait_stream), SSZ(Slot, generation), SSZ(Slot, holds),
    SSZ(Slot, index), SSZ(Slot, saved_refs), BOOL(Slot, late), BOOL(Slot, pending), {NULL}};
static PyMemberDef ops_members[] = {
    OBJ(Ops, _by_ptr), OBJ(Ops, _index), OBJ(Ops, _raw), OBJ(Ops, capturing), OBJ(Ops, device), OBJ(Ops, record),
    OBJ(Ops, wait), BOOL(Ops, cuda), {NULL}};
static PyMemberDef ring_members[] = {
    OBJ(Ring, _phase), OBJ(Ring, _slots), OBJ(Ring, _by_id), OBJ(Ring, _ops), OBJ(Ring, _fallback),
    OBJ(Ring, _watchdog), OBJ(Ring, max_shape), OBJ(Ring, _slot_map), OBJ(Ring, _lock), OBJ(Ring, _spare_events),
    OBJ(Ring, _hot), SSZ(Ring, slot_bytes), SSZ(Ring, _cursor), SSZ(Ring, num_slots), SSZ(Ring, _generation), SSZ(Ring, _acquisitions), SSZ(Ring, _held),
    SSZ(Ring, _deferred_freed), SSZ(Ring, _peak_held), SSZ(Ring, _gpu_waits), SSZ(Ring, _elided),
    SSZ(Ring, _releases), SSZ(Ring, _epoch), SSZ(Ring, _deferred), SSZ(Ring, _marks_elided),
    SSZ(Ring, _deferred_elided), BOOL(Ring, debug), BOOL(Ring, _cuda), BOOL(Ring, _elide), {NULL}};
static PyMemberDef held_members[] = {
    OBJ(Held, pool), OBJ(Held, name), OBJ(Held, tensor), OBJ(Held, entry), SSZ(Held, lo), SSZ(Held, hi),
    BOOL(Held, released), BOOL(Held, deferred), {NULL}};
static PyMemberDef route_members[] = {
    OBJ(Route, pool), OBJ(Route, name), OBJ(Route, entry), OBJ(Route, dtype), OBJ(Route, queue),
    OBJ(Route, te_forward), SSZ(Route, cols), SSZ(Route, row_bytes), {NULL}};
static PyMemberDef tracker_members[] = {
    OBJ(Tracker, _push), OBJ(Tracker, _pop), SSZ(Tracker, _depth), SSZ(Tracker, regions), BOOL(Tracker, strict),
    {NULL}};
static PyMemberDef saved_ref_members[] = {
    OBJ(SavedRef, tensor), OBJ(SavedRef, ring), OBJ(SavedRef, slot), SSZ(SavedRef, generation),
    SSZ(SavedRef, epoch), {NULL}};

/* traverse / clear / dealloc over a struct's object fields: one generic set, driven by the member table */
#define FIELD(o, m) (*(PyObject **)((char *)(o) + (m)->offset))

static PyMemberDef *members_of(PyTypeObject *t);

static int state_traverse(PyObject *self, visitproc visit, void *arg) {
  for (PyMemberDef *m = members_of(Py_TYPE(self)); m && m->name; m++)
    if (m->type == T_OBJECT_EX) Py_VISIT(FIELD(self, m));
  /* a Python subclass's type and __dict__ are visited by its own traverse (subtype_traverse) */
  return 0;
}

static int state_clear(PyObject *self) {
  for (PyMemberDef *m = members_of(Py_TYPE(self)); m && m->name; m++)
    if (m->type == T_OBJECT_EX) Py_CLEAR(FIELD(self, m));
  return 0;
}

static void state_dealloc(PyObject *self) {
  PyObject_GC_UnTrack(self);
  state_clear(self);
  Py_TYPE(self)->tp_free(self);
}

#define STATE_TYPE(var, Name, T, members, doc)                                                            \
  static PyTypeObject var = {                                                                            \
      PyVarObject_HEAD_INIT(NULL, 0).tp_name = "bufreuse.native._hotpath." Name,                           \
      .tp_basicsize = sizeof(T),                                                                         \
      .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,                         \
      .tp_new = PyType_GenericNew,                                                                       \
      .tp_traverse = state_traverse,                                                                     \
      .tp_clear = state_clear,                                                                           \
      .tp_dealloc = state_dealloc,                                                                       \
      .tp_members = members,                                                                             \
      .tp_doc = doc,                                                                                     \
  };

STATE_TYPE(SlotType, "Slot", Slot, slot_members, "A ring slot's fields (base of bufreuse.pool._state._Slot)")
STATE_TYPE(OpsType, "Ops", Ops, ops_members, "DeviceOps' fields (base of bufreuse.pool._device.DeviceOps)")
STATE_TYPE(RingType, "Ring", Ring, ring_members, "A ring's hot fields (base of bufreuse.pool.ring.BufferRing)")
STATE_TYPE(HeldType, "Held", Held, held_members, "An acquisition's fields (base of integrations.core.Held)")
STATE_TYPE(RouteType, "Route", Route, route_members, "An FC2 route's fields (base of te.out_route.Fc2Route)")
STATE_TYPE(TrackerType, "Tracker", Tracker, tracker_members, "A region's fields (base of tracking.SavedTracker)")
/* its dealloc and finalizer (the deferred release) are set at module init, below */
STATE_TYPE(SavedRefType, "SavedRef", SavedRef, saved_ref_members,
           "A saved reference's fields and its release when freed (base of tracking._SavedRef)")

static PyMemberDef *members_of(PyTypeObject *t) {
  for (; t != NULL; t = t->tp_base) {
    if (t == &SlotType) return slot_members;
    if (t == &OpsType) return ops_members;
    if (t == &RingType) return ring_members;
    if (t == &HeldType) return held_members;
    if (t == &RouteType) return route_members;
    if (t == &TrackerType) return tracker_members;
    if (t == &SavedRefType) return saved_ref_members;
  }
  return NULL;
}

#define IS(o, T) PyObject_TypeCheck((o), &T)

/* set a struct's object field (NULL-safe: an unset field reads as missing in Python, the C code treats it so) */
static void put(PyObject **field, PyObject *value) {
  Py_XINCREF(value);
  Py_XSETREF(*field, value);
}

/* ---- small helpers --------------------------------------------------------------------------------- */

/* x.name() / x.name(arg) through the descriptor cached for x's exact type, else by lookup */
static PyObject *call0(PyObject *x, PyTypeObject *type, PyObject *descr, PyObject *name) {
  if (descr != NULL && Py_TYPE(x) == type) return PyObject_Vectorcall(descr, &x, 1, NULL);
  return PyObject_CallMethodNoArgs(x, name);
}

static PyObject *call1(PyObject *x, PyTypeObject *type, PyObject *descr, PyObject *name, PyObject *arg) {
  if (descr != NULL && Py_TYPE(x) == type) {
    PyObject *args[2] = {x, arg};
    return PyObject_Vectorcall(descr, args, 2, NULL);
  }
  return PyObject_CallMethodOneArg(x, name, arg);
}

#define TENSOR_CALL(x, D, n) call0((x), TENSOR, (D), (n))

/* tensor.data_ptr() as an integer; -1 (no error) where the Python code's try/except would give up */
static int data_ptr(PyObject *x, long long *out) {
  PyObject *v = TENSOR_CALL(x, T_DATA_PTR, s_data_ptr);
  if (v == NULL) {
    if (PyErr_ExceptionMatches(PyExc_AttributeError) || PyErr_ExceptionMatches(PyExc_RuntimeError) ||
        PyErr_ExceptionMatches(PyExc_TypeError)) {
      PyErr_Clear();
      *out = -1;
      return 0;
    }
    return -1;
  }
  *out = PyLong_AsLongLong(v);
  Py_DECREF(v);
  return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* the current stream as DeviceOps.current_stream caches it (a new reference); FALLBACK when not cached yet */
static int current_stream(Ops *ops, PyObject **out) {
  if (ops->_raw == NULL || ops->_raw == Py_None || ops->_index == NULL || ops->_by_ptr == NULL ||
      !PyDict_CheckExact(ops->_by_ptr))
    return FALLBACK;
  PyObject *ptr = PyObject_CallOneArg(ops->_raw, ops->_index);
  if (ptr == NULL) return -1;
  PyObject *stream = PyDict_GetItemWithError(ops->_by_ptr, ptr);
  Py_DECREF(ptr);
  if (stream == NULL) return PyErr_Occurred() ? -1 : FALLBACK;
  *out = Py_NewRef(stream);
  return DONE;
}

/* ---- the ring's lock and reader marks ------------------------------------------------------------------
 * The Python code takes the ring's RLock around saved-reference counts and deferral (readers finish on autograd's
 * threads). The C paths take it without blocking and leave the case to Python when another thread holds it (Python
 * then waits for it); on the thread holding it already (a holder freed by the collector inside a locked section)
 * they enter, as Python's reentrant lock lets its code. Between taking and giving it back they make no
 * allocation that could run the collector and no call that could let another thread in, except record(): an event
 * recorded under the lock, in the same order as Python's _mark and _record_release (torch's Event.record makes no
 * Python object; it may let another thread run, which then finds the lock taken). */

static int lock_try(Ring *ring) { /* 1: taken, 0: another thread has it, -1: error */
  if (ring->_lock == NULL) return 0;
  PyObject *r = PyObject_CallMethodOneArg(ring->_lock, s_acquire, Py_False);
  if (r == NULL) return -1;
  int t = PyObject_IsTrue(r);
  Py_DECREF(r);
  return t;
}

/* gives the lock back; an error already raised stays the one raised (the release's own error chained to it) */
static int lock_give(Ring *ring) {
  PyObject *pending = PyErr_GetRaisedException();
  PyObject *r = PyObject_CallMethodNoArgs(ring->_lock, s_release);
  if (r == NULL) {
    if (pending != NULL) {
      PyObject *again = PyErr_GetRaisedException();
      PyException_SetContext(pending, again);
      PyErr_SetRaisedException(pending);
    }
    return -1;
  }
  Py_DECREF(r);
  PyErr_SetRaisedException(pending);
  return 0;
}

static int record(Ops *ops, PyObject *event, PyObject *stream) {
  PyObject *args[2] = {event, stream};
  PyObject *r = PyObject_Vectorcall(ops->record, args, 2, NULL);
  if (r == NULL) return -1;
  Py_DECREF(r);
  return 0;
}

/* _mark(slot, stream), planned: which of its cases applies, before anything changes. MARK_NONE: the stream's reader
 * mark is there, elided (nothing to do); MARK_RECORD: there, recorded (record it again on the stream); MARK_APPEND:
 * none, a spare event goes into a new mark (elided in eager while the ring elides, else recorded now); FALLBACK: no
 * spare event (Python makes one), a phase other than eager, or no way to record. */
#define MARK_NONE 1
#define MARK_RECORD 2
#define MARK_APPEND 3
static int mark_plan(Ring *ring, Slot *slot, PyObject *stream, Ops *ops) {
  if (slot->marks == NULL || !PyList_CheckExact(slot->marks) || ring->_phase != EAGER) return FALLBACK;
  Py_ssize_t n = PyList_GET_SIZE(slot->marks);
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *m = PyList_GET_ITEM(slot->marks, i);
    if (!PyTuple_CheckExact(m) || PyTuple_GET_SIZE(m) != 3) return FALLBACK;
    if (PyTuple_GET_ITEM(m, 0) == stream) {
      int late = PyObject_IsTrue(PyTuple_GET_ITEM(m, 2));
      if (late < 0) return -1;
      if (late) return MARK_NONE;
      return ops->record == NULL ? FALLBACK : MARK_RECORD;
    }
  }
  if (ring->_spare_events == NULL || !PyList_CheckExact(ring->_spare_events) ||
      PyList_GET_SIZE(ring->_spare_events) == 0 || (!ring->_elide && ops->record == NULL))
    return FALLBACK;
  return MARK_APPEND;
}

/* the planned mark, done (under the ring's lock, as Python's _mark): `fresh` is a 3-tuple made before the lock */
static int mark_apply(Ring *ring, Slot *slot, Ops *ops, int plan, PyObject *stream, PyObject *fresh) {
  if (plan == MARK_NONE) return 0;
  if (plan == MARK_RECORD) {
    Py_ssize_t n = PyList_GET_SIZE(slot->marks);
    for (Py_ssize_t i = 0; i < n; i++) {
      PyObject *m = PyList_GET_ITEM(slot->marks, i);
      if (PyTuple_GET_ITEM(m, 0) == stream) {
        PyObject *event = Py_NewRef(PyTuple_GET_ITEM(m, 1));
        int r = record(ops, event, stream); /* re-recording on the same stream still covers the earlier reads */
        Py_DECREF(event);
        return r;
      }
    }
    return 0;
  }
  Py_ssize_t n = PyList_GET_SIZE(ring->_spare_events);
  PyObject *event = Py_NewRef(PyList_GET_ITEM(ring->_spare_events, n - 1));
  if (PyList_SetSlice(ring->_spare_events, n - 1, n, NULL) < 0) {
    Py_DECREF(event);
    return -1;
  }
  int late = ring->_elide;
  if (!late && record(ops, event, stream) < 0) {
    Py_DECREF(event);
    return -1;
  }
  PyTuple_SET_ITEM(fresh, 0, Py_NewRef(stream));
  PyTuple_SET_ITEM(fresh, 1, event);
  PyTuple_SET_ITEM(fresh, 2, Py_NewRef(late ? Py_True : Py_False));
  if (PyList_Append(slot->marks, fresh) < 0) return -1;
  if (late) ring->_marks_elided += 1;
  return 0;
}

/* the deferred paths' start on a CUDA ring: its ops, the current stream and an empty 3-tuple for a new reader mark,
 * made before the lock (nothing is allocated under it); DONE (new references in *stream, *fresh), FALLBACK or -1.
 * On a CPU ring: DONE with nothing set. */
static int mark_prologue(Ring *ring, Ops **ops, PyObject **stream, PyObject **fresh) {
  if (!ring->_cuda) return DONE;
  if (ring->_ops == NULL || !IS(ring->_ops, OpsType)) return FALLBACK;
  *ops = (Ops *)ring->_ops;
  int r = current_stream(*ops, stream);
  if (r != DONE) return r;
  if ((*fresh = PyTuple_New(3)) == NULL) {
    Py_CLEAR(*stream);
    return -1;
  }
  return DONE;
}

/* ---- acquire ---------------------------------------------------------------------------------------- */

/* BufferRing.acquire(shape) in eager, production mode, when the cursor's slot is free; FALLBACK otherwise
 * (before any change). *out: the acquisition (new reference). */
static int acquire_impl(PyObject *ring_, PyObject *shape, PyObject **out) {
  if (!IS(ring_, RingType)) return FALLBACK;
  Ring *ring = (Ring *)ring_;
  if (ring->debug || ring->_phase != EAGER || ring->_slots == NULL || !PyList_CheckExact(ring->_slots) ||
      ring->_cursor < 0 || ring->_cursor >= PyList_GET_SIZE(ring->_slots) || ring->_by_id == NULL ||
      !PyDict_CheckExact(ring->_by_id) || ring->max_shape == NULL || !PyTuple_CheckExact(ring->max_shape))
    return FALLBACK;
  PyObject *slot_ = PyList_GET_ITEM(ring->_slots, ring->_cursor);
  if (!IS(slot_, SlotType)) return FALLBACK;
  Slot *slot = (Slot *)slot_;
  if (slot->live != Py_None || slot->base == NULL) return FALLBACK;
  PyObject *bound = ring->max_shape;
  Py_ssize_t rows = -1;
  if (shape != Py_None) {
    /* the hot path's form: a tuple (rows, *bound[1:]) with 0 <= rows <= bound[0]; anything else: Python */
    Py_ssize_t n = PyTuple_GET_SIZE(bound);
    if (!PyTuple_CheckExact(shape) || PyTuple_GET_SIZE(shape) != n || n < 1 ||
        !PyLong_CheckExact(PyTuple_GET_ITEM(shape, 0)))
      return FALLBACK;
    for (Py_ssize_t i = 1; i < n; i++) {
      int eq = PyObject_RichCompareBool(PyTuple_GET_ITEM(shape, i), PyTuple_GET_ITEM(bound, i), Py_EQ);
      if (eq != 1) return eq < 0 ? -1 : FALLBACK;
    }
    Py_ssize_t max_rows = PyLong_AsSsize_t(PyTuple_GET_ITEM(bound, 0));
    rows = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, 0));
    if (PyErr_Occurred()) { /* a row count beyond any integer: Python's StaticShapeError */
      if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
      PyErr_Clear();
      return FALLBACK;
    }
    if (rows < 0 || rows > max_rows) return FALLBACK;
    if (rows == max_rows) rows = -1; /* the whole bound: detach(), as the Python code */
  }
  PyObject *stream = NULL;
  Ops *ops = NULL;
  int need_wait = 0, r;
  if (ring->_cuda) {
    if (ring->_ops == NULL || !IS(ring->_ops, OpsType)) return FALLBACK;
    ops = (Ops *)ring->_ops;
    if ((r = current_stream(ops, &stream)) != DONE) return r;
    r = FALLBACK;
    PyObject *c = ops->capturing == NULL ? NULL : PyObject_CallNoArgs(ops->capturing);
    if (c != NULL) {
      r = PyObject_IsTrue(c);
      Py_DECREF(c);
      r = r < 0 ? -1 : (r ? FALLBACK : DONE); /* capturing: a per-layer graph on an eager ring, Python raises */
    } else if (ops->capturing != NULL) {
      r = -1;
    }
    need_wait = slot->wait_on != NULL && slot->wait_on != Py_None && slot->wait_stream != stream;
    /* an elided event to record first, or a watchdog to tell: Python */
    if (r == DONE && need_wait &&
        (slot->late || (ring->_watchdog != NULL && ring->_watchdog != Py_None) || ops->wait == NULL))
      r = FALLBACK;
    if (r != DONE) {
      Py_DECREF(stream);
      return r;
    }
  }
  /* every check passed: from here on the acquisition happens */
  PyObject *view;
  if (rows < 0) {
    view = TENSOR_CALL(slot->base, T_DETACH, s_detach);
  } else {
    PyObject *stop = PyLong_FromSsize_t(rows);
    PyObject *sl = stop ? PySlice_New(NULL, stop, NULL) : NULL;
    Py_XDECREF(stop);
    view = sl ? PyObject_GetItem(slot->base, sl) : NULL;
    Py_XDECREF(sl);
  }
  if (view == NULL) {
    Py_XDECREF(stream);
    return -1;
  }
  Py_INCREF(slot);
  if (ops != NULL) {
    if (need_wait) {
      PyObject *args[2] = {slot->wait_on, stream};
      PyObject *w = PyObject_Vectorcall(ops->wait, args, 2, NULL);
      if (w == NULL) goto fail;
      Py_DECREF(w);
      ring->_gpu_waits += 1;
    }
    put(&slot->wait_on, Py_None);
    slot->late = 0;
    put(&slot->made_on, stream);
  }
  slot->generation = ++ring->_generation;
  put(&slot->live, view);
  PyObject *key = PyLong_FromVoidPtr(view);
  r = key ? PyDict_SetItem(ring->_by_id, key, slot_) : -1;
  Py_XDECREF(key);
  if (r < 0) goto fail;
  ring->_cursor = ring->_cursor + 1 < ring->num_slots ? ring->_cursor + 1 : 0;
  ring->_acquisitions += 1;
  ring->_held += 1;
  Py_ssize_t held = ring->_held - ring->_deferred_freed;
  if (ring->_fallback != NULL && ring->_fallback != Py_None) {
    Py_ssize_t n = PyObject_Size(ring->_fallback);
    if (n < 0) goto fail;
    held += n;
  }
  if (held > ring->_peak_held) ring->_peak_held = held;
  Py_DECREF(slot);
  Py_XDECREF(stream);
  *out = view;
  return DONE;
fail:
  Py_DECREF(slot);
  Py_XDECREF(stream);
  Py_DECREF(view);
  return -1;
}

static PyObject *py_acquire(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "acquire(ring, shape)");
    return NULL;
  }
  PyObject *view = NULL;
  int r = acquire_impl(args[0], args[1], &view);
  if (r < 0) return NULL;
  if (r == FALLBACK) Py_RETURN_NONE;
  return view;
}

/* ---- release ---------------------------------------------------------------------------------------- */

/* release_when_unsaved's deferral in its common cases: DEFERRED, or FALLBACK before any change. A saved reference
 * or a hold still reads the slot: it stays held (pending), and this reader's mark is left on the current stream for
 * the final release to join (elided in eager: recorded only if the final release comes on another stream). */
static int defer_impl(Ring *ring, Slot *slot, PyObject *key) {
  PyObject *stream = NULL, *fresh = NULL;
  Ops *ops = NULL;
  int r, plan = MARK_NONE;
  if ((r = mark_prologue(ring, &ops, &stream, &fresh)) != DONE) return r;
  if ((r = lock_try(ring)) != 1) goto out; /* 0: another thread is in a locked section: Python waits for it */
  if (!(slot->saved_refs || slot->holds)) { /* the last reader went meanwhile: Python's immediate release */
    r = FALLBACK;
    goto unlock;
  }
  if (ops != NULL && (plan = mark_plan(ring, slot, stream, ops)) <= 0) {
    r = plan;
    goto unlock;
  }
  /* deferred from here on */
  r = PyDict_DelItem(ring->_by_id, key) < 0 ? -1 : DEFERRED;
  if (r == DEFERRED) {
    slot->pending = 1;
    ring->_deferred += 1;
    if (ops != NULL && mark_apply(ring, slot, ops, plan, stream, fresh) < 0) r = -1;
  }
unlock:
  if (lock_give(ring) < 0) r = -1;
out:
  Py_XDECREF(stream);
  Py_XDECREF(fresh);
  return r;
}

/* BufferRing.release_when_unsaved(tensor) (defer) or release(tensor) on the current stream, eager, production mode:
 * DONE when nothing else reads the slot (no saved reference, hold or reader mark), DEFERRED (defer only) when
 * something does, in defer_impl's cases; FALLBACK otherwise (before any change). */
static int release_impl(PyObject *ring_, PyObject *tensor, int defer) {
  if (!IS(ring_, RingType)) return FALLBACK;
  Ring *ring = (Ring *)ring_;
  if (ring->debug || ring->_phase != EAGER || ring->_by_id == NULL || !PyDict_CheckExact(ring->_by_id))
    return FALLBACK;
  PyObject *key = PyLong_FromVoidPtr(tensor);
  if (key == NULL) return -1;
  PyObject *slot_ = PyDict_GetItemWithError(ring->_by_id, key);
  int r = FALLBACK;
  if (slot_ == NULL || !IS(slot_, SlotType)) { /* not a live slot acquisition (a fallback allocation, ...): Python */
    r = PyErr_Occurred() ? -1 : FALLBACK;
    Py_DECREF(key);
    return r;
  }
  Slot *slot = (Slot *)Py_NewRef(slot_); /* held across the calls below, which run Python */
  PyObject *stream = NULL;
  Ops *ops = NULL;
  if (defer && (slot->saved_refs || slot->holds)) {
    r = defer_impl(ring, slot, key);
    goto out;
  }
  if (slot->saved_refs || slot->holds || slot->marks == NULL || !PyList_CheckExact(slot->marks) ||
      PyList_GET_SIZE(slot->marks) != 0 || slot->eager_event == NULL)
    goto out;
  if (ring->_cuda) {
    if (ring->_ops == NULL || !IS(ring->_ops, OpsType)) goto out;
    ops = (Ops *)ring->_ops;
    if ((r = current_stream(ops, &stream)) != DONE) goto out;
    if (!(slot->made_on == stream && ring->_elide) && ops->record == NULL) {
      r = FALLBACK;
      goto out;
    }
  }
  /* released now */
  r = PyDict_DelItem(ring->_by_id, key) < 0 ? -1 : DONE;
  if (r == DONE && ops != NULL) {
    if (slot->made_on == stream && ring->_elide) { /* same stream: ordered by it; recorded only if another producer comes */
      put(&slot->wait_on, slot->eager_event);
      put(&slot->wait_stream, stream);
      slot->late = 1;
      ring->_elided += 1;
    } else {
      PyObject *args[2] = {slot->eager_event, stream};
      PyObject *rec = PyObject_Vectorcall(ops->record, args, 2, NULL);
      if (rec == NULL) {
        r = -1;
      } else {
        Py_DECREF(rec);
        put(&slot->wait_on, slot->eager_event);
        put(&slot->wait_stream, stream);
        slot->late = 0;
      }
    }
  }
  if (r == DONE) {
    put(&slot->live, Py_None);
    ring->_held -= 1;
    ring->_releases += 1;
  }
out:
  Py_DECREF(slot);
  Py_XDECREF(stream);
  Py_DECREF(key);
  return r;
}

static PyObject *py_release(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "release(ring, tensor)");
    return NULL;
  }
  int r = release_impl(args[0], args[1], 0);
  if (r < 0) return NULL;
  if (r == FALLBACK) Py_RETURN_NONE;
  Py_RETURN_TRUE;
}

static PyObject *py_release_when_unsaved(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "release_when_unsaved(ring, tensor)");
    return NULL;
  }
  int r = release_impl(args[0], args[1], 1);
  if (r < 0) return NULL;
  if (r == FALLBACK) Py_RETURN_NONE;
  return Py_NewRef(r == DONE ? Py_True : Py_False);
}

/* Held.release(): once; the ring's immediate release, else its Python release_when_unsaved */
static int held_release_impl(PyObject *held_) {
  if (!IS(held_, HeldType)) {
    PyErr_SetString(PyExc_TypeError, "held_release: not a Held");
    return -1;
  }
  Held *held = (Held *)held_;
  if (held->released) return 0;
  held->released = 1;
  if (held->entry == NULL || held->tensor == NULL) {
    PyErr_SetString(PyExc_AttributeError, "Held without entry or tensor");
    return -1;
  }
  PyObject *entry = Py_NewRef(held->entry), *tensor = Py_NewRef(held->tensor);
  int deferred = 0, r = release_impl(entry, tensor, 1);
  if (r == DEFERRED) {
    deferred = 1;
    r = DONE;
  } else if (r == FALLBACK) {
    PyObject *now = PyObject_CallMethodOneArg(entry, s_release_when_unsaved, tensor);
    if (now == NULL) {
      r = -1;
    } else {
      int t = PyObject_IsTrue(now);
      Py_DECREF(now);
      r = t < 0 ? -1 : DONE;
      deferred = !t;
    }
  }
  Py_DECREF(entry);
  Py_DECREF(tensor);
  if (r < 0) return -1;
  held->deferred = (char)deferred;
  return 0;
}

static PyObject *py_held_release(PyObject *mod, PyObject *held) {
  if (held_release_impl(held) < 0) return NULL;
  Py_RETURN_NONE;
}

/* ---- saved references ------------------------------------------------------------------------------- */

/* SavedRefCounting._untrack(slot, generation, epoch), a saved reference freed by autograd, in eager production mode:
 * DONE, or FALLBACK before any change. The last reader of a deferred slot releases it on the current stream (the
 * backward's), joining reader marks on that same stream only (marks on another stream: Python waits on them). */
static int untrack_impl(PyObject *ring_, PyObject *slot_, Py_ssize_t generation, Py_ssize_t epoch) {
  if (!IS(ring_, RingType) || !IS(slot_, SlotType)) return FALLBACK;
  Ring *ring = (Ring *)ring_;
  Slot *slot = (Slot *)slot_;
  /* poisoning, capture events, a pool kept on the Python path (no _hot: BufferPool(native=False)): Python */
  if (ring->debug || ring->_phase != EAGER || ring->_hot == NULL || ring->_hot == Py_None) return FALLBACK;
  PyObject *stream = NULL, *fresh = NULL;
  Ops *ops = NULL;
  int r;
  if ((r = mark_prologue(ring, &ops, &stream, &fresh)) != DONE) return r;
  Py_INCREF(ring);
  Py_INCREF(slot);
  if ((r = lock_try(ring)) != 1) goto out;
  r = DONE;
  if (epoch != ring->_epoch || slot->generation != generation || slot->saved_refs <= 0) goto unlock; /* stale */
  if (slot->pending && slot->saved_refs == 1 && !slot->holds) { /* the last reader: released now */
    Py_ssize_t n = 0;
    int elided = 0;
    if (ops != NULL) {
      if (slot->marks == NULL || !PyList_CheckExact(slot->marks) || ring->_spare_events == NULL ||
          !PyList_CheckExact(ring->_spare_events) || slot->eager_event == NULL) {
        r = FALLBACK;
        goto unlock;
      }
      n = PyList_GET_SIZE(slot->marks);
      for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *m = PyList_GET_ITEM(slot->marks, i);
        if (!PyTuple_CheckExact(m) || PyTuple_GET_SIZE(m) != 3 || PyTuple_GET_ITEM(m, 0) != stream) {
          r = FALLBACK; /* a reader on another stream to wait for (maybe to record first): Python */
          goto unlock;
        }
      }
      elided = slot->made_on == stream && ring->_elide;
      if (!elided && ops->record == NULL) {
        r = FALLBACK;
        goto unlock;
      }
    }
    slot->saved_refs -= 1;
    if (ops != NULL) {
      for (Py_ssize_t i = 0; i < n; i++) /* same stream: ordered by it; the events go back to the spares */
        if (PyList_Append(ring->_spare_events, PyTuple_GET_ITEM(PyList_GET_ITEM(slot->marks, i), 1)) < 0) {
          r = -1;
          goto unlock;
        }
      if (PyList_SetSlice(slot->marks, 0, n, NULL) < 0) {
        r = -1;
        goto unlock;
      }
      if (!elided && record(ops, slot->eager_event, stream) < 0) { /* before the slot reads as free */
        r = -1;
        goto unlock;
      }
      put(&slot->wait_on, slot->eager_event);
      put(&slot->wait_stream, stream);
      slot->late = (char)elided;
      if (elided) ring->_deferred_elided += 1;
    }
    slot->pending = 0;
    put(&slot->live, Py_None); /* last: acquire (no lock) sees the event before the free slot */
    ring->_deferred_freed += 1;
  } else {
    int plan = MARK_NONE;
    if (ops != NULL && (plan = mark_plan(ring, slot, stream, ops)) <= 0) {
      r = plan;
      goto unlock;
    }
    slot->saved_refs -= 1;
    if (ops != NULL && mark_apply(ring, slot, ops, plan, stream, fresh) < 0) r = -1;
  }
unlock:
  if (lock_give(ring) < 0) r = -1;
out:
  Py_DECREF(ring);
  Py_DECREF(slot);
  Py_XDECREF(stream);
  Py_XDECREF(fresh);
  return r;
}

static PyObject *py_untrack(PyObject *mod, PyObject *args) {
  PyObject *ring, *slot;
  Py_ssize_t generation, epoch;
  if (!PyArg_ParseTuple(args, "OOnn", &ring, &slot, &generation, &epoch)) return NULL;
  int r = untrack_impl(ring, slot, generation, epoch);
  if (r < 0) return NULL;
  if (r == FALLBACK) Py_RETURN_NONE;
  Py_RETURN_TRUE;
}

static PyTypeObject *SAVED_CLS = NULL; /* tracking._SavedRef: what the C pack makes (saved_ref_class) */

/* SavedRefCounting._track(tensor, storage, strict=False), the slot found by the tensor's offset as _slot_for finds it,
 * production mode: DONE (*out: a
 * counted reference, or the tensor itself for a free slot), or FALLBACK before any change */
static int track_impl(PyObject *ring_, PyObject *tensor, long long ptr, PyObject *storage, PyObject **out) {
  if (SAVED_CLS == NULL || !IS(ring_, RingType)) return FALLBACK;
  Ring *ring = (Ring *)ring_;
  if (ring->debug || ring->_slot_map == NULL || !PyDict_CheckExact(ring->_slot_map) || ring->_slots == NULL ||
      !PyList_CheckExact(ring->_slots))
    return FALLBACK;
  PyObject *where = PyDict_GetItemWithError(ring->_slot_map, storage);
  if (where == NULL) return PyErr_Occurred() ? -1 : FALLBACK;
  if (!PyTuple_CheckExact(where) || PyTuple_GET_SIZE(where) != 2) return FALLBACK;
  Py_ssize_t first = PyLong_AsSsize_t(PyTuple_GET_ITEM(where, 0)), count = PyLong_AsSsize_t(PyTuple_GET_ITEM(where, 1));
  long long base = PyLong_AsLongLong(storage);
  if (PyErr_Occurred()) return -1;
  if (count < 1 || ring->slot_bytes <= 0 || ptr < base) return FALLBACK;
  /* _slot_for: the slot the tensor starts in (its offset in the storage), the storage's last for an offset past it */
  long long k = (ptr - base) / ring->slot_bytes;
  Py_ssize_t index = first + (Py_ssize_t)(k < count - 1 ? k : count - 1);
  if (first < 0 || index >= PyList_GET_SIZE(ring->_slots)) return FALLBACK;
  PyObject *slot_ = PyList_GET_ITEM(ring->_slots, index);
  if (!IS(slot_, SlotType)) return FALLBACK;
  Slot *slot = (Slot *)Py_NewRef(slot_);
  SavedRef *ref = (SavedRef *)SAVED_CLS->tp_alloc(SAVED_CLS, 0); /* before the lock: the collector may run here */
  int r = ref == NULL ? -1 : lock_try(ring);
  if (r != 1) {
    Py_XDECREF(ref); /* unfilled: its finalizer does nothing */
    Py_DECREF(slot);
    return r;
  }
  if (slot->live == Py_None) { /* a free slot (non-strict): the tensor itself, as Python */
    *out = Py_NewRef(tensor);
    Py_DECREF(ref);
    Py_DECREF(slot);
  } else {
    slot->saved_refs += 1;
    ref->tensor = Py_NewRef(tensor);
    ref->ring = Py_NewRef(ring_);
    ref->generation = slot->generation;
    ref->epoch = ring->_epoch;
    ref->slot = (PyObject *)slot; /* our reference */
    *out = (PyObject *)ref;
  }
  if (lock_give(ring) < 0) {
    Py_CLEAR(*out);
    return -1;
  }
  return DONE;
}

/* a freed saved reference counts down (the deferred release when it was the last reader): _SavedRef.__del__ */
static void saved_ref_finalize(PyObject *self_) {
  SavedRef *self = (SavedRef *)self_;
  if (self->ring == NULL || self->ring == Py_None || self->slot == NULL) return;
  PyObject *exc = PyErr_GetRaisedException();
  PyObject *ring = Py_NewRef(self->ring), *slot = Py_NewRef(self->slot);
  int r = untrack_impl(ring, slot, self->generation, self->epoch);
  if (r == FALLBACK) {
    PyObject *g = PyLong_FromSsize_t(self->generation), *e = PyLong_FromSsize_t(self->epoch);
    PyObject *res = g && e ? PyObject_CallMethodObjArgs(ring, s__untrack, slot, g, e, NULL) : NULL;
    Py_XDECREF(g);
    Py_XDECREF(e);
    r = res == NULL ? -1 : DONE;
    Py_XDECREF(res);
  }
  if (r < 0) PyErr_WriteUnraisable(self_);
  Py_DECREF(ring);
  Py_DECREF(slot);
  PyErr_SetRaisedException(exc);
}

static void saved_ref_dealloc(PyObject *self) {
  if (PyObject_CallFinalizerFromDealloc(self) < 0) return; /* resurrected by the finalizer */
  state_dealloc(self);
}

/* the unpack hook: a counted reference gives its tensor back (Python's unpack raises for a reacquired slot) */
static PyObject *py_unpack(PyObject *mod, PyObject *packed) {
  if (IS(packed, SavedRefType)) {
    SavedRef *ref = (SavedRef *)packed;
    if (ref->tensor != NULL && ref->slot != NULL && IS(ref->slot, SlotType) &&
        ((Slot *)ref->slot)->generation == ref->generation)
      return Py_NewRef(ref->tensor);
    return PyObject_CallMethodNoArgs(packed, s_unpack);
  }
  return Py_NewRef(packed);
}

static PyObject *py_saved_ref_class(PyObject *mod, PyObject *cls) {
  if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, &SavedRefType)) {
    PyErr_SetString(PyExc_TypeError, "saved_ref_class: a subclass of _hotpath.SavedRef");
    return NULL;
  }
  Py_XSETREF(SAVED_CLS, (PyTypeObject *)Py_NewRef(cls));
  Py_RETURN_NONE;
}

/* ---- the hook objects' fields -------------------------------------------------------------------------
 * Pack, AfterStage and IntoRing lay out their object fields (their __dict__ included) right after the header and
 * end with their vectorcall pointer: one traverse / clear / dealloc walks those fields for all three. */

#define HOOK_FIELDS(o) ((PyObject **)((char *)(o) + sizeof(PyObject)))
#define HOOK_NFIELDS(o) \
  ((Py_ssize_t)((Py_TYPE(o)->tp_basicsize - sizeof(PyObject) - sizeof(vectorcallfunc)) / sizeof(PyObject *)))

static int hook_traverse(PyObject *self, visitproc visit, void *arg) {
  for (Py_ssize_t i = 0; i < HOOK_NFIELDS(self); i++) Py_VISIT(HOOK_FIELDS(self)[i]);
  return 0;
}

static int hook_clear(PyObject *self) {
  for (Py_ssize_t i = 0; i < HOOK_NFIELDS(self); i++) Py_CLEAR(HOOK_FIELDS(self)[i]);
  return 0;
}

static void hook_dealloc(PyObject *self) {
  PyObject_GC_UnTrack(self);
  hook_clear(self);
  Py_TYPE(self)->tp_free(self);
}

/* ---- Pack: the saved-tensor pack hook ---------------------------------------------------------------- */

typedef struct {
  PyObject_HEAD
  PyObject *spans;  /* list of (first, end, ring, storage pointer), mutated in place by StorageIndex.add */
  PyObject *strict; /* bool */
  vectorcallfunc vectorcall;
} Pack;
_Static_assert(offsetof(Pack, vectorcall) + sizeof(vectorcallfunc) == sizeof(Pack), "hook_traverse: fields, then vectorcall last");

static PyObject *pack_call(PyObject *self_, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
  Pack *self = (Pack *)self_;
  if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL) {
    PyErr_SetString(PyExc_TypeError, "pack(tensor)");
    return NULL;
  }
  PyObject *tensor = args[0];
  if (self->spans == NULL) return Py_NewRef(tensor); /* cleared by the collector */
  PyObject *v = TENSOR_CALL(tensor, T_DATA_PTR, s_data_ptr);
  if (v == NULL) {
    if (PyErr_ExceptionMatches(PyExc_AttributeError) || PyErr_ExceptionMatches(PyExc_RuntimeError) ||
        PyErr_ExceptionMatches(PyExc_TypeError) || PyErr_ExceptionMatches(PyExc_NotImplementedError)) {
      PyErr_Clear();
      return Py_NewRef(tensor);
    }
    return NULL;
  }
  int overflow = 0;
  long long ptr = PyLong_AsLongLongAndOverflow(v, &overflow);
  Py_DECREF(v);
  if (ptr == -1 && PyErr_Occurred()) return NULL;
  if (overflow) return Py_NewRef(tensor); /* no ring storage there */
  Py_ssize_t n = PyList_GET_SIZE(self->spans);
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *span = PyList_GET_ITEM(self->spans, i);
    if (!PyTuple_Check(span) || PyTuple_GET_SIZE(span) != 4) {
      PyErr_SetString(PyExc_TypeError, "Pack: a span is not (first, end, ring, storage)");
      return NULL;
    }
    long long first = PyLong_AsLongLong(PyTuple_GET_ITEM(span, 0));
    long long end = PyLong_AsLongLong(PyTuple_GET_ITEM(span, 1));
    if ((first == -1 || end == -1) && PyErr_Occurred()) return NULL;
    if (first <= ptr && ptr < end) {
      PyObject *ring = Py_NewRef(PyTuple_GET_ITEM(span, 2)), *storage = Py_NewRef(PyTuple_GET_ITEM(span, 3));
      PyObject *out = NULL;
      int r = self->strict == Py_False ? track_impl(ring, tensor, ptr, storage, &out) : FALLBACK; /* strict: Python */
      if (r != FALLBACK) {
        Py_DECREF(ring);
        Py_DECREF(storage);
        return r < 0 ? NULL : out;
      }
      out = PyObject_CallMethodObjArgs(ring, s__track, tensor, storage, self->strict, NULL);
      Py_DECREF(ring);
      Py_DECREF(storage);
      return out;
    }
  }
  return Py_NewRef(tensor);
}

static PyObject *pack_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  PyObject *spans, *strict;
  if (!PyArg_ParseTuple(args, "O!O", &PyList_Type, &spans, &strict)) return NULL;
  Pack *self = (Pack *)type->tp_alloc(type, 0);
  if (self == NULL) return NULL;
  int is_strict = PyObject_IsTrue(strict);
  if (is_strict < 0) {
    Py_DECREF(self);
    return NULL;
  }
  self->spans = Py_NewRef(spans);
  self->strict = Py_NewRef(is_strict ? Py_True : Py_False);
  self->vectorcall = pack_call;
  return (PyObject *)self;
}

/* the spans tuples are (int, int, ring, int): checked where they are made (StorageIndex.add), and here */
static PyTypeObject PackType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "bufreuse.native._hotpath.Pack",
    .tp_basicsize = sizeof(Pack),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(Pack, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = pack_new,
    .tp_traverse = hook_traverse,
    .tp_clear = hook_clear,
    .tp_dealloc = hook_dealloc,
    .tp_doc = "Pack(spans, strict): the saved-tensor pack hook over a StorageIndex's spans",
};

/* ---- region calls --------------------------------------------------------------------------------------- */

/* fn(*args) inside the tracker's saved-tensor region: SavedTracker.run without its frame */
static PyObject *tracked_call(Tracker *tracker, PyObject *fn, PyObject *const *args, size_t nargsf,
                              PyObject *kwnames) {
  if (tracker->_push == NULL || tracker->_pop == NULL) {
    PyErr_SetString(PyExc_AttributeError, "SavedTracker without its hooks");
    return NULL;
  }
  PyObject *p = PyObject_CallNoArgs(tracker->_push);
  if (p == NULL) return NULL;
  Py_DECREF(p);
  if (tracker->_depth == 0) tracker->regions += 1;
  tracker->_depth += 1;
  PyObject *pop = Py_NewRef(tracker->_pop);
  PyObject *out = PyObject_Vectorcall(fn, args, nargsf, kwnames);
  PyObject *exc = out == NULL ? PyErr_GetRaisedException() : NULL;
  tracker->_depth -= 1;
  PyObject *q = PyObject_CallNoArgs(pop);
  Py_DECREF(pop);
  if (q == NULL) { /* the finally block raised: as in Python, its exception wins, the stage's as its context */
    Py_XDECREF(out);
    if (exc != NULL) {
      PyObject *again = PyErr_GetRaisedException();
      PyException_SetContext(again, exc);
      PyErr_SetRaisedException(again);
    }
    return NULL;
  }
  Py_DECREF(q);
  if (exc != NULL) PyErr_SetRaisedException(exc);
  return out;
}

/* ---- AfterStage -------------------------------------------------------------------------------------- */

typedef struct {
  PyObject_HEAD
  PyObject *stage, *queue, *tracker, *dict;
  vectorcallfunc vectorcall;
} AfterStage;
_Static_assert(offsetof(AfterStage, vectorcall) + sizeof(vectorcallfunc) == sizeof(AfterStage), "hook_traverse: fields, then vectorcall last");

static int in_span(PyObject *held, long long ptr) {
  if (!IS(held, HeldType)) {
    PyErr_SetString(PyExc_TypeError, "AfterStage: the queue holds something other than Held");
    return -1;
  }
  return ((Held *)held)->lo <= ptr && ptr < ((Held *)held)->hi;
}

static PyObject *after_call(PyObject *self_, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
  AfterStage *self = (AfterStage *)self_;
  if (self->stage == NULL || self->queue == NULL || self->tracker == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "AfterStage: cleared");
    return NULL;
  }
  Py_ssize_t queued = PyObject_Size(self->queue);
  if (queued < 0) return NULL;
  if (queued == 0) return PyObject_Vectorcall(self->stage, args, nargsf, kwnames);
  Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  PyObject *first = nargs ? args[0] : (kwnames && PyTuple_GET_SIZE(kwnames) ? args[0] : Py_None);
  long long ptr;
  if (data_ptr(first, &ptr) < 0) return NULL;
  int track = 0;
  for (Py_ssize_t i = 0; i < queued && !track; i++) { /* any queued acquisition: robust to one a raising forward left */
    PyObject *held = PySequence_GetItem(self->queue, i);
    if (held == NULL) return NULL;
    track = in_span(held, ptr);
    Py_DECREF(held);
    if (track < 0) return NULL;
  }
  PyObject *out = track ? tracked_call((Tracker *)self->tracker, self->stage, args, nargsf, kwnames)
                        : PyObject_Vectorcall(self->stage, args, nargsf, kwnames);
  if (out == NULL) return NULL;
  if ((queued = PyObject_Size(self->queue)) < 0) goto fail;
  if (queued) {
    PyObject *front = PySequence_GetItem(self->queue, 0);
    if (front == NULL) goto fail;
    long long optr;
    int inside = data_ptr(out, &optr) < 0 ? -1 : in_span(front, optr);
    Py_DECREF(front);
    if (inside < 0) goto fail;
    if (!inside) { /* the stage's output no longer views the front acquisition: it was its last reader */
      PyObject *h = call0(self->queue, DEQUE, D_POPLEFT, s_popleft);
      if (h == NULL) goto fail;
      int r = held_release_impl(h);
      Py_DECREF(h);
      if (r < 0) goto fail;
    }
  }
  return out;
fail:
  Py_DECREF(out);
  return NULL;
}

static PyObject *after_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  PyObject *stage, *queue, *tracker;
  if (!PyArg_ParseTuple(args, "OOO!", &stage, &queue, &TrackerType, &tracker)) return NULL;
  AfterStage *self = (AfterStage *)type->tp_alloc(type, 0);
  if (self == NULL) return NULL;
  self->stage = Py_NewRef(stage);
  self->queue = Py_NewRef(queue);
  self->tracker = Py_NewRef(tracker);
  self->dict = NULL;
  self->vectorcall = after_call;
  return (PyObject *)self;
}

/* copy.copy / copy.deepcopy of a hook give the hook itself, as for the Python functions they stand in for (a model
 * deep-copied while hooked shares its hooks) */
static PyObject *same_copy(PyObject *self, PyObject *unused) { return Py_NewRef(self); }

static PyMethodDef hook_methods[] = {
    {"__copy__", same_copy, METH_NOARGS, NULL},
    {"__deepcopy__", same_copy, METH_O, NULL},
    {NULL},
};

static PyGetSetDef with_dict_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL},
};

static PyTypeObject AfterStageType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "bufreuse.native._hotpath.AfterStage",
    .tp_basicsize = sizeof(AfterStage),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(AfterStage, vectorcall),
    .tp_dictoffset = offsetof(AfterStage, dict),
    .tp_getset = with_dict_getset,
    .tp_methods = hook_methods,
    .tp_call = PyVectorcall_Call,
    .tp_new = after_new,
    .tp_traverse = hook_traverse,
    .tp_clear = hook_clear,
    .tp_dealloc = hook_dealloc,
    .tp_doc = "AfterStage(stage, queue, tracker): a stage that releases the queue's front after its last reader",
};

/* ---- IntoRing ---------------------------------------------------------------------------------------- */

typedef struct {
  PyObject_HEAD
  PyObject *route_attr, *fallback, *held_type, *ignored, *dict;
  vectorcallfunc vectorcall;
} IntoRing;
_Static_assert(offsetof(IntoRing, vectorcall) + sizeof(vectorcallfunc) == sizeof(IntoRing), "hook_traverse: fields, then vectorcall last");

static PyObject *new_held(PyObject *held_type, Route *route, PyObject *entry, PyObject *slot, long long lo,
                          Py_ssize_t rows) {
  PyTypeObject *t = (PyTypeObject *)held_type;
  Held *held = (Held *)t->tp_alloc(t, 0);
  if (held == NULL) return NULL;
  put(&held->pool, route->pool);
  put(&held->name, route->name);
  put(&held->tensor, slot);
  put(&held->entry, entry);
  held->lo = (Py_ssize_t)lo;
  held->hi = (Py_ssize_t)(lo + (long long)rows * route->row_bytes);
  return (PyObject *)held;
}

/* the slot goes back (Python's release) and the pending exception (or `ignored()`'s) is raised */
static PyObject *give_back(PyObject *entry, PyObject *slot, PyObject *ignored) {
  PyObject *exc = PyErr_GetRaisedException();
  if (exc == NULL) { /* TE returned other storage: the contract error, made by Python (or what making it raised) */
    PyObject *e = PyObject_CallNoArgs(ignored);
    exc = e != NULL ? e : PyErr_GetRaisedException();
  }
  PyObject *r = PyObject_CallMethodOneArg(entry, s_release, slot);
  if (r == NULL) { /* as `except BaseException: release(); raise`: the release's error wins, chained */
    PyObject *again = PyErr_GetRaisedException();
    PyException_SetContext(again, exc);
    PyErr_SetRaisedException(again);
    return NULL;
  }
  Py_DECREF(r);
  PyErr_SetRaisedException(exc);
  return NULL;
}

static PyObject *into_call(PyObject *self_, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
  IntoRing *self = (IntoRing *)self_;
  if (self->fallback == NULL || self->route_attr == NULL || self->held_type == NULL || self->ignored == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "IntoRing: cleared");
    return NULL;
  }
  Py_ssize_t nargs = PyVectorcall_NARGS(nargsf), nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  if (nargs < 3) return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
  for (Py_ssize_t i = 0; i < nkw; i++) { /* out= given: Python refuses it */
    int eq = PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, i), s_out);
    if (eq == -1 && PyErr_Occurred()) return NULL;
    if (eq == 0) return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
  }
  PyObject *module = args[0], *inp = args[1];
  PyObject *mdict = PyObject_GenericGetDict(module, NULL), *route_ = NULL, *shape = NULL, *slot = NULL;
  PyObject *result = NULL, *held = NULL, *kw2 = NULL, **args2 = NULL, *entry = NULL;
  if (mdict == NULL) {
    PyErr_Clear();
    return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
  }
  route_ = PyDict_Check(mdict) ? PyDict_GetItemWithError(mdict, self->route_attr) : NULL;
  Py_XINCREF(route_);
  Py_DECREF(mdict);
  if (route_ == NULL || !IS(route_, RouteType)) {
    Py_XDECREF(route_);
    if (PyErr_Occurred()) return NULL;
    return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
  }
  Route *route = (Route *)route_;
  int r, fast = 0;
  Py_ssize_t rows = 0;
  if (route->entry == NULL || route->dtype == NULL || route->queue == NULL || route->te_forward == NULL) goto slow;
  entry = Py_NewRef(route->entry);
  {
    PyObject *dtype = T_DTYPE != NULL && Py_TYPE(inp) == TENSOR
                          ? Py_TYPE(T_DTYPE)->tp_descr_get(T_DTYPE, inp, (PyObject *)TENSOR)
                          : PyObject_GetAttr(inp, s_dtype);
    if (dtype == NULL) goto done;
    r = dtype == route->dtype;
    Py_DECREF(dtype);
    if (!r) goto slow; /* a dtype refusal: Python's words */
    /* inp.shape[0] through the getter (not len(tensor): Tensor.__len__ is Python code that reads shape[0]) */
    PyObject *r0, *ishape = T_SHAPE != NULL && Py_TYPE(inp) == TENSOR
                                ? Py_TYPE(T_SHAPE)->tp_descr_get(T_SHAPE, inp, (PyObject *)TENSOR)
                                : PyObject_GetAttr(inp, s_shape);
    if (ishape == NULL) goto done;
    if (PyTuple_Check(ishape) && PyTuple_GET_SIZE(ishape) > 0)
      r0 = Py_NewRef(PyTuple_GET_ITEM(ishape, 0));
    else
      r0 = PySequence_GetItem(ishape, 0); /* a 0-d tensor: IndexError, as Python's shape[0] */
    Py_DECREF(ishape);
    if (r0 == NULL) goto done;
    if (!PyLong_CheckExact(r0)) { /* a symbolic size: the Python route, which converts it (nothing acquired yet) */
      Py_DECREF(r0);
      goto slow;
    }
    rows = PyLong_AsSsize_t(r0);
    PyObject *cols = PyLong_FromSsize_t(route->cols);
    shape = (rows == -1 && PyErr_Occurred()) || cols == NULL ? NULL : PyTuple_Pack(2, r0, cols);
    Py_DECREF(r0);
    Py_XDECREF(cols);
    if (shape == NULL) goto done;
    if ((r = acquire_impl(entry, shape, &slot)) < 0) goto done;
    fast = r == DONE;
  }
slow:
  if (!fast) { /* a dtype refusal, a full ring, debug, capture, ...: the Python route, which acquired nothing yet */
    result = PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    goto done;
  }
  long long lo, ylo;
  {
    PyObject *v = TENSOR_CALL(slot, T_DATA_PTR, s_data_ptr);
    lo = v != NULL ? PyLong_AsLongLong(v) : -1;
    Py_XDECREF(v);
    if (lo == -1 && PyErr_Occurred()) { /* as Python: the error itself, the slot given back */
      give_back(entry, slot, self->ignored);
      goto done;
    }
  }
  /* te_forward(module, inp, m_splits, *rest, out=slot, **kwargs) */
  args2 = PyMem_Malloc(sizeof(PyObject *) * (nargs + nkw + 1));
  kw2 = PyTuple_New(nkw + 1);
  if (args2 == NULL || kw2 == NULL) {
    if (args2 == NULL) PyErr_NoMemory();
    give_back(entry, slot, self->ignored);
    goto done;
  }
  for (Py_ssize_t i = 0; i < nargs + nkw; i++) args2[i] = args[i];
  for (Py_ssize_t i = 0; i < nkw; i++) PyTuple_SET_ITEM(kw2, i, Py_NewRef(PyTuple_GET_ITEM(kwnames, i)));
  PyTuple_SET_ITEM(kw2, nkw, Py_NewRef(s_out));
  args2[nargs + nkw] = slot;
  result = PyObject_Vectorcall(route->te_forward, args2, nargs, kw2);
  if (result == NULL) {
    give_back(entry, slot, self->ignored);
    goto done;
  }
  {
    PyObject *y = PyTuple_CheckExact(result) && PyTuple_GET_SIZE(result) ? PyTuple_GET_ITEM(result, 0) : result;
    PyObject *v = TENSOR_CALL(y, T_DATA_PTR, s_data_ptr);
    ylo = v ? PyLong_AsLongLong(v) : -1;
    Py_XDECREF(v);
    if (v == NULL || PyErr_Occurred() || ylo != lo) {
      Py_CLEAR(result);
      give_back(entry, slot, self->ignored);
      goto done;
    }
  }
  if ((held = new_held(self->held_type, route, entry, slot, lo, rows)) == NULL) {
    Py_CLEAR(result); /* as Python: an error after TE's forward leaves the slot acquired, unqueued */
    goto done;
  }
  {
    PyObject *a = call1(route->queue, DEQUE, D_APPEND, s_append, held);
    if (a == NULL) {
      Py_CLEAR(result);
      goto done;
    }
    Py_DECREF(a);
  }
done:
  Py_DECREF(route_);
  Py_XDECREF(entry);
  Py_XDECREF(shape);
  Py_XDECREF(slot);
  Py_XDECREF(held);
  Py_XDECREF(kw2);
  if (args2) PyMem_Free(args2);
  return result;
}

static PyObject *into_get(PyObject *self, PyObject *obj, PyObject *type) {
  if (obj == NULL || obj == Py_None) return Py_NewRef(self);
  return PyMethod_New(self, obj);
}

static PyObject *into_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  PyObject *route_attr, *fallback, *held_type, *ignored;
  if (!PyArg_ParseTuple(args, "UOOO", &route_attr, &fallback, &held_type, &ignored)) return NULL;
  if (!PyType_Check(held_type) || !PyType_IsSubtype((PyTypeObject *)held_type, &HeldType)) {
    PyErr_SetString(PyExc_TypeError, "IntoRing: held_type must be a subclass of _hotpath.Held");
    return NULL;
  }
  IntoRing *self = (IntoRing *)type->tp_alloc(type, 0);
  if (self == NULL) return NULL;
  self->route_attr = Py_NewRef(route_attr);
  self->fallback = Py_NewRef(fallback);
  self->held_type = Py_NewRef(held_type);
  self->ignored = Py_NewRef(ignored);
  self->dict = NULL;
  self->vectorcall = into_call;
  return (PyObject *)self;
}

static PyTypeObject IntoRingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "bufreuse.native._hotpath.IntoRing",
    .tp_basicsize = sizeof(IntoRing),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_vectorcall_offset = offsetof(IntoRing, vectorcall),
    .tp_dictoffset = offsetof(IntoRing, dict),
    .tp_getset = with_dict_getset,
    .tp_methods = hook_methods,
    .tp_call = PyVectorcall_Call,
    .tp_descr_get = into_get,
    .tp_new = into_new,
    .tp_traverse = hook_traverse,
    .tp_clear = hook_clear,
    .tp_dealloc = hook_dealloc,
    .tp_doc = "IntoRing(route_attr, fallback, held_type, ignored): forward(module, inp, ...) with out= a ring slot",
};

/* ---- module ------------------------------------------------------------------------------------------ */

static PyObject *py_configure(PyObject *mod, PyObject *args) {
  PyObject *eager, *tensor, *deque;
  if (!PyArg_ParseTuple(args, "OO!O!", &eager, &PyType_Type, &tensor, &PyType_Type, &deque)) return NULL;
  PyObject *data_ptr = PyObject_GetAttr(tensor, s_data_ptr), *detach = PyObject_GetAttr(tensor, s_detach);
  PyObject *dtype = PyObject_GetAttr(tensor, s_dtype); /* on the class: the getset descriptor itself */
  PyObject *shape = PyObject_GetAttr(tensor, s_shape);
  PyObject *popleft = PyObject_GetAttr(deque, s_popleft), *append = PyObject_GetAttr(deque, s_append);
  if (data_ptr == NULL || detach == NULL || popleft == NULL || append == NULL || dtype == NULL ||
      Py_TYPE(dtype)->tp_descr_get == NULL || shape == NULL || Py_TYPE(shape)->tp_descr_get == NULL) {
    Py_XDECREF(data_ptr);
    Py_XDECREF(detach);
    Py_XDECREF(dtype);
    Py_XDECREF(shape);
    Py_XDECREF(popleft);
    Py_XDECREF(append);
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "configure: not torch.Tensor / collections.deque");
    return NULL;
  }
  Py_XSETREF(EAGER, Py_NewRef(eager));
  Py_XSETREF(TENSOR, (PyTypeObject *)Py_NewRef(tensor));
  Py_XSETREF(DEQUE, (PyTypeObject *)Py_NewRef(deque));
  Py_XSETREF(T_DATA_PTR, data_ptr);
  Py_XSETREF(T_DETACH, detach);
  Py_XSETREF(T_DTYPE, dtype);
  Py_XSETREF(T_SHAPE, shape);
  Py_XSETREF(D_POPLEFT, popleft);
  Py_XSETREF(D_APPEND, append);
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", py_configure, METH_VARARGS, "configure(Phase.EAGER, torch.Tensor, collections.deque): once"},
    {"acquire", (PyCFunction)(void (*)(void))py_acquire, METH_FASTCALL,
     "acquire(ring, shape): the acquisition, or None where BufferRing.acquire must run"},
    {"release", (PyCFunction)(void (*)(void))py_release, METH_FASTCALL,
     "release(ring, tensor): True (released now), or None where release_when_unsaved must run"},
    {"release_when_unsaved", (PyCFunction)(void (*)(void))py_release_when_unsaved, METH_FASTCALL,
     "release_when_unsaved(ring, tensor): True (released now), False (deferred), or None where the method must run"},
    {"held_release", py_held_release, METH_O, "held_release(held): Held.release()"},
    {"untrack", py_untrack, METH_VARARGS,
     "untrack(ring, slot, generation, epoch): True, or None where SavedRefCounting._untrack must run"},
    {"unpack", py_unpack, METH_O, "unpack(packed): the saved-tensor unpack hook"},
    {"saved_ref_class", py_saved_ref_class, METH_O, "saved_ref_class(cls): the class the C pack makes (once)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_hotpath", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hotpath(void) {
#define INTERN(n) \
  if ((s_##n = PyUnicode_InternFromString(#n)) == NULL) return NULL;
  NAMES(INTERN)
#undef INTERN
  if ((EMPTY = PyTuple_New(0)) == NULL) return NULL;
  SavedRefType.tp_dealloc = saved_ref_dealloc;
  SavedRefType.tp_finalize = saved_ref_finalize;
  if (PyType_Ready(&PackType) < 0 || PyType_Ready(&AfterStageType) < 0 || PyType_Ready(&IntoRingType) < 0 ||
      PyType_Ready(&SlotType) < 0 || PyType_Ready(&OpsType) < 0 || PyType_Ready(&RingType) < 0 ||
      PyType_Ready(&HeldType) < 0 || PyType_Ready(&RouteType) < 0 || PyType_Ready(&TrackerType) < 0 ||
      PyType_Ready(&SavedRefType) < 0)
    return NULL;
  PyObject *m = PyModule_Create(&moduledef);
  if (m == NULL) return NULL;
  if (PyModule_AddObjectRef(m, "Pack", (PyObject *)&PackType) < 0 ||
      PyModule_AddObjectRef(m, "AfterStage", (PyObject *)&AfterStageType) < 0 ||
      PyModule_AddObjectRef(m, "IntoRing", (PyObject *)&IntoRingType) < 0 ||
      PyModule_AddObjectRef(m, "Slot", (PyObject *)&SlotType) < 0 ||
      PyModule_AddObjectRef(m, "Ops", (PyObject *)&OpsType) < 0 ||
      PyModule_AddObjectRef(m, "Ring", (PyObject *)&RingType) < 0 ||
      PyModule_AddObjectRef(m, "Held", (PyObject *)&HeldType) < 0 ||
      PyModule_AddObjectRef(m, "Route", (PyObject *)&RouteType) < 0 ||
      PyModule_AddObjectRef(m, "Tracker", (PyObject *)&TrackerType) < 0 ||
      PyModule_AddObjectRef(m, "SavedRef", (PyObject *)&SavedRefType) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
