// Auto-refresh: re-fetch this page and swap every element marked data-refresh (by id).
// Inlined with the page's CSP nonce; no other script runs on the dashboard.
(function () {
  var box = document.getElementById("auto-refresh");
  var stamp = document.getElementById("updated");
  var every = Number(document.body.getAttribute("data-refresh-ms")) || 10000;
  var key = "compaction-proxy.autorefresh";
  if (!box) return;
  box.checked = localStorage.getItem(key) !== "off";
  box.addEventListener("change", function () {
    localStorage.setItem(key, box.checked ? "on" : "off");
  });
  function tick() {
    if (!box.checked || document.hidden) return;
    fetch(location.href, { credentials: "same-origin", cache: "no-store" })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) {
        if (!html) return;
        var doc = new DOMParser().parseFromString(html, "text/html");
        document.querySelectorAll("[data-refresh]").forEach(function (el) {
          var fresh = doc.getElementById(el.id);
          if (fresh) el.replaceWith(document.importNode(fresh, true));
        });
        if (stamp) stamp.textContent = "updated " + new Date().toLocaleTimeString();
      })
      .catch(function () {});
  }
  setInterval(tick, every);
})();
