// The server's API as the dashboard uses it: the API key (asked for when the server has one, kept
// for this tab only) and fetch wrappers that send it. Paths are relative, so the page also works
// behind a proxy that serves the server under a prefix.

const KEY = "jaxserve-api-key";

export const authRequired = document.querySelector('meta[name="jaxserve-auth"]').content === "required";

export class AuthError extends Error {}

export function hasKey() {
  return Boolean(sessionStorage.getItem(KEY));
}

export function headers(extra = {}) {
  const key = sessionStorage.getItem(KEY);
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

// The message of an OpenAI error envelope, or the status.
export async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error?.message ?? `HTTP ${response.status}`;
  } catch {
    return `HTTP ${response.status}`;
  }
}

export async function getJSON(path) {
  const response = await fetch(path, { headers: headers(), cache: "no-store" });
  if (response.status === 401) throw new AuthError(await errorMessage(response));
  if (!response.ok) throw new Error(await errorMessage(response));
  return response.json();
}

// Shows the key dialog; resolves once a key is entered (and kept for this tab).
export function askKey(message) {
  const dialog = document.getElementById("key-dialog");
  const input = document.getElementById("key-input");
  document.getElementById("key-message").textContent = message;
  dialog.hidden = false;
  input.value = "";
  input.focus();
  return new Promise((resolve) => {
    document.getElementById("key-form").onsubmit = (event) => {
      event.preventDefault();
      sessionStorage.setItem(KEY, input.value.trim());
      dialog.hidden = true;
      resolve();
    };
  });
}
